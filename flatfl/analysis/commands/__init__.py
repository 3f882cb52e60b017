"""What the analysis commands run: each analysis' settings object (:mod:`.hessian_settings`,
:mod:`.client_metrics_settings`, :mod:`.surface_settings`, on :mod:`.settings`; torch-free) and its command
(:mod:`.hessian_command`, :mod:`.clients_command`, :mod:`.surface_command`, on the skeleton :mod:`.skeleton`), the
result files and their readers (:mod:`.result_files`, :mod:`.surface_files`), the figures (:mod:`.figures`), the
progress bar's phases (:mod:`.progress`) and the observer of curvature tracking (:mod:`.tracking`). Nothing is
imported here, so the settings stay torch-free."""
