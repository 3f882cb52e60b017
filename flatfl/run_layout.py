"""A run folder's layout and its analyses: the names both :mod:`flatfl.sweep` and :mod:`flatfl.report` use.

A finished run holds ``final.pt`` (the server model) and ``final-clients-average.pt`` (the average of all clients'
latest models, written on demand by :func:`model_checkpoint`); each analysis lives in a folder of its own,
:func:`analysis_dir`. :func:`analyse_run` computes the analyses asked for, each skipped when its result is there,
newer than the checkpoint and made with the settings asked for.
"""
from __future__ import annotations

from pathlib import Path

from .checkpoint import CLIENTS_AVERAGE_FILE, FINAL_FILE, read_checkpoint, save_clients_average
from .errors import CheckpointError, unknown_name

__all__ = ["HESSIAN_DIR", "SPECTRUM_DIR", "CLIENTS_DIR", "SURFACE_DIR", "MODEL_CHECKPOINTS", "analysis_dir",
           "model_checkpoint", "settings_match", "analyse_run"]

HESSIAN_DIR = "hessian"  # RUN/hessian/hessian.json: Hessian results (and the 'clients' section when computed)
SPECTRUM_DIR = "spectrum"  # RUN/spectrum/hessian.json: a second Hessian analysis, the top-k and density (MAN Fig. 4)
CLIENTS_DIR = HESSIAN_DIR  # run_client_metrics writes clients-<protocol>.json beside hessian.json
SURFACE_DIR = "surface"  # RUN/surface/surface.npz
# the two models a run ends with: the server's, and the average of all clients' latest models (MAN's and FedDyn's
# reported accuracy); each analysis folder is suffixed with the model unless it is the server's
MODEL_CHECKPOINTS = {"server": FINAL_FILE, "clients-average": CLIENTS_AVERAGE_FILE}


def analysis_dir(kind: str, model: str = "server") -> str:
    """The folder of a run holding ``kind`` ('hessian', 'spectrum', 'surface') of ``model``: ``hessian`` for the
    server model, ``hessian-clients-average`` for the all-clients average."""
    if model not in MODEL_CHECKPOINTS:
        raise unknown_name("model", model, MODEL_CHECKPOINTS)
    return kind if model == "server" else f"{kind}-{model}"


def model_checkpoint(run_dir: str | Path, model: str = "server") -> Path:
    """The checkpoint of ``model`` in a finished run. Runs trained before final-clients-average.pt existed (or
    whose final.pt was recovered from a round checkpoint) get it written now from final.pt's 'all_state_dict'."""
    run_dir = Path(run_dir)
    final = run_dir / FINAL_FILE
    if model not in MODEL_CHECKPOINTS:
        raise unknown_name("model", model, MODEL_CHECKPOINTS)
    if not final.is_file():
        raise CheckpointError(f"{run_dir} has no final.pt: the run is not finished (resume it first)")
    path = run_dir / MODEL_CHECKPOINTS[model]
    if model != "server" and (not path.is_file() or path.stat().st_mtime < final.stat().st_mtime):
        payload = read_checkpoint(final)  # validated; a format-1 spec completed (flatfl.checkpoint)
        if "all_state_dict" not in payload:
            raise CheckpointError(f"{final} holds no all-clients average (written by an older flatfl)")
        save_clients_average(run_dir, payload)
    return path


def _stored(reader, path: Path) -> dict | None:
    """A result file read by its reader (:mod:`flatfl.analysis.commands.result_files`); a damaged one counts as absent, so
    that it is computed again."""
    from .analysis.commands.result_files import ResultFileError

    try:
        return reader(path)
    except ResultFileError:
        return None


#: settings where None asks for something of its own, and how a result file may record that: the whole split, no
#: relative stopping rule, cross-entropy
_NONE_MEANS = {"samples": (None,), "trace_rtol": (None,), "loss": (None, "cross_entropy")}
_NEVER_COMPARED = ("device", "quiet", "data_dir", "model_factory")  # where and how it ran, the network's builder


def settings_match(saved: dict | None, wanted: dict) -> bool:
    """True when every setting asked for was used. Device, data folder and model factory may differ (the weights
    and data are checked by digest). A None asks for the default: the whole split (``samples``), no relative stop
    (``trace_rtol``), cross-entropy (``loss``), the eigenvalue method's own trace estimator (``trace_method``, which
    result files record as it ran); other None settings (a protocol's own batch size) are not compared. A setting
    an older result file did not record counts as what it computed then (``BEFORE_RECORDED``)."""
    from .analysis.commands.hessian_settings import BEFORE_RECORDED

    if not isinstance(saved, dict):
        return False
    for key, value in wanted.items():
        if key in _NEVER_COMPARED:
            continue
        if value is None and key == "trace_method":
            from .analysis.commands.hessian_settings import HessianSettings

            try:
                value = HessianSettings(method=wanted.get("method", HessianSettings.method)).resolved_trace_method
            except Exception:  # an unknown method: nothing stored matches it
                return False
        if value is None:
            if key in _NONE_MEANS and saved.get(key) not in _NONE_MEANS[key]:
                return False
        elif saved.get(key, BEFORE_RECORDED.get(key)) != value:
            return False
    return True


def _fresh(result: Path, final: Path, data: dict | None = None) -> bool:
    """The result is newer than the checkpoint and (where it records one) measured the checkpoint's weights: a
    result copied in from another run is computed again, never skipped."""
    if not (result.is_file() and result.stat().st_mtime >= final.stat().st_mtime):
        return False
    recorded = (data or {}).get("weights_sha256")
    return not isinstance(recorded, str) or recorded == _weights_digest(final)


def _weights_digest(checkpoint: Path) -> str:
    """sha256 of a checkpoint's weights (:func:`flatfl.utils.provenance.state_digest`)."""
    from .utils.provenance import state_digest

    return state_digest(read_checkpoint(checkpoint)["state_dict"])


def _hessian(run_dir: Path, final: Path, wanted: dict, quiet: bool, folder: str = HESSIAN_DIR) -> str:
    """Compute into RUN/folder unless an analysis of ``final`` with the wanted settings is there (one made with other
    settings, or of another model, is replaced: callers that keep it choose another folder)."""
    from .analysis.commands.hessian_command import run_hessian
    from .analysis.commands.hessian_settings import HessianSettings
    from .analysis.commands.result_files import read_hessian_file

    out = run_dir / folder
    report = _stored(read_hessian_file, out / "hessian.json")
    if report and _fresh(out / "hessian.json", final, report) and report.get("top_eigenvalues") is not None \
            and Path(str(report.get("checkpoint", ""))).name == final.name \
            and settings_match(report.get("settings"), wanted):
        return "skipped"
    run_hessian(str(final), str(out), HessianSettings.from_mapping(wanted), quiet=quiet, replace=True)
    return "computed"


def _clients(run_dir: Path, final: Path, wanted: dict, quiet: bool) -> str:
    from .analysis.commands.client_metrics_settings import ClientMetricsSettings
    from .analysis.commands.clients_command import run_client_metrics
    from .analysis.commands.result_files import clients_file, read_clients_file

    out = run_dir / CLIENTS_DIR
    path = out / clients_file(wanted.get("protocol", "default"))
    section = _stored(read_clients_file, path) or {}
    if section and _fresh(path, final, section) and settings_match(section.get("settings"), wanted):
        return "skipped"
    run_client_metrics(str(final), str(out), ClientMetricsSettings.from_mapping(wanted), quiet=quiet,
                       replace=True)  # the grid says what it holds
    return "computed"


def _surface(run_dir: Path, final: Path, wanted: dict, quiet: bool, folder: str = SURFACE_DIR) -> str:
    from .analysis.commands.result_files import read_surface_file
    from .analysis.commands.surface_command import run_surface
    from .analysis.commands.surface_settings import SurfaceSettings

    out = run_dir / folder
    summary = _stored(read_surface_file, out / "surface.json")
    if summary and _fresh(out / "surface.json", final, summary):
        s = summary.get("settings", {})
        vectors = wanted.get("eigenvectors")  # recorded by its digest
        if all(s.get(k) == v for k, v in wanted.items() if k in s and k not in ("device", "workers")) and \
                (vectors is None or s.get("eigenvectors_sha1") == _file_sha1(vectors)):
            return "skipped"
    run_surface(str(final), str(out), SurfaceSettings.from_mapping(wanted), quiet=quiet)
    return "computed"


def _file_sha1(path) -> str | None:
    from .analysis.estimators.surface_files import file_sha1

    try:
        return file_sha1(path)
    except OSError:
        return None


def analyse_run(run_dir: str | Path, *, hessian: dict | None = None, spectrum: dict | None = None,
                clients: dict | None = None, surface: dict | None = None, quiet: bool = True,
                model: str = "server", hessian_dir: str | None = None) -> dict:
    """The analyses of one finished run, each skipped when its result is there, newer than the model's checkpoint
    and made with the settings asked for. ``model`` ('server' or 'clients-average', :data:`MODEL_CHECKPOINTS`)
    chooses the checkpoint the Hessian, spectrum and surface measure; their folders are
    :func:`analysis_dir` (``hessian``, ``spectrum``, ``surface``, suffixed ``-clients-average`` for that model),
    or ``hessian_dir`` for the Hessian. ``clients`` (H_N, H_D) takes the clients' own models (clients.pt).
    Returns {'hessian': 'computed'|'skipped'|None, ...}."""
    run_dir = Path(run_dir)
    final = run_dir / FINAL_FILE
    if not final.is_file():
        raise CheckpointError(f"{run_dir} has no final.pt: the run is not finished (resume it first)")
    ckpt = model_checkpoint(run_dir, model) if (hessian, spectrum, surface) != (None, None, None) else final
    return {"hessian": (_hessian(run_dir, ckpt, dict(hessian), quiet, hessian_dir or analysis_dir("hessian", model))
                        if hessian is not None else None),
            "clients": _clients(run_dir, final, dict(clients), quiet) if clients is not None else None,
            "spectrum": (_hessian(run_dir, ckpt, dict(spectrum), quiet, analysis_dir("spectrum", model))
                         if spectrum is not None else None),
            "surface": (_surface(run_dir, ckpt, dict(surface), quiet, analysis_dir("surface", model))
                        if surface is not None else None)}
