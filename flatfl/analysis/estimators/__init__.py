"""The estimators, functions typed on the operator contract: their registry (:mod:`.registry`, torch-free, read by
the command line) and the dispatch by name (:mod:`.by_name`); eigenvalues (:mod:`.eigen`, :mod:`.power`), traces
(:mod:`.trace`), spectral densities (:mod:`.density`), per-layer blocks (:mod:`.per_layer`), cross-client metrics
(:mod:`.client_metrics`), with the random vectors they draw (:mod:`flatfl.analysis.operators.vectors`); and the loss surface
(:mod:`.surface`, its directions :mod:`.directions`). Nothing is imported here, so the registry stays torch-free."""
