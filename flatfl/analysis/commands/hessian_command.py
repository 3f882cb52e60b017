"""What ``flatfl hessian`` does: checkpoint in; ``hessian.json``, ``eigenvalues.csv`` and figures out.

* :func:`compute` runs the estimators its settings ask for on any operator and returns a JSON-ready report (plus
  the raw results), so it works on user models without a checkpoint.
* :func:`write_outputs` renders the figures in memory and only then writes every file atomically (one file at a
  time with :mod:`flatfl.utils.io`, ``hessian.json`` last): a failure while computing leaves no output at all.
* :func:`run_hessian` validates the settings, loads the checkpoint and its evaluation set (the skeleton of
  :mod:`flatfl.analysis.commands.skeleton`), and chains the two. One :class:`~flatfl.analysis.commands.hessian_settings.HessianSettings`
  travels through them: the command line (or a grid file, a preset, Python) builds it, :func:`run_hessian` takes it
  whole, :func:`compute` reads it and :func:`settings_record` writes it into hessian.json. The estimators are chosen
  by name from the registry (:mod:`flatfl.analysis.estimators.by_name`); the figures are
  :func:`flatfl.analysis.commands.result_figures.hessian_figures`; the file is read back with
  :func:`flatfl.analysis.commands.result_files.read_hessian_file`.

Outputs in ``--out DIR`` (the command line's default: the run's ``hessian`` folder,
:func:`flatfl.cli.analysis_commands.default_out`): ``hessian.json`` (``curvature`` and ``measured``: the matrix and
how it was measured; the eigenvalues ``--which`` asks for, with residuals ``||Hv - lambda v||``, error estimates
``min(r, r^2 / gap)`` never below the products' rounding (``eigen.rounding_floor``) and converged flags;
``eigenvalue_ratio``, lambda_1 / lambda_5 when at least five of the largest are computed; trace with standard error;
``products``: how the products were computed, whether exactly and, for finite differences, their stated relative
error; SLQ nodes and weights; HVP counts, seconds, settings, the samples used and asked for, checkpoint path, round,
parameter count), ``eigenvalues.csv``, ``eigenvalues.png/.pdf`` (the top-k on a
log axis and each one's residual and error estimate; when k >= 2), ``density.png/.pdf`` (spectral density as MAN
Fig. 4b: every SLQ start averaged, Gaussian width stated, log axis from 1e-4 of the peak; with ``--density``), ``eigenvectors.pt`` with ``--save-eigenvectors`` (read it with :func:`load_eigenvectors`), and with
``--per-layer`` ``per_layer.csv`` and ``per_layer.png/.pdf`` (each module's Hessian block,
:mod:`flatfl.analysis.estimators.per_layer`). ``--loss module:function`` replaces cross-entropy by ``function(model, batch)``
(:mod:`flatfl.analysis.operators.objective`). ``--curvature ggn`` or ``empirical-fisher`` measures the generalized
Gauss-Newton matrix or the empirical Fisher instead of the Hessian (:mod:`flatfl.analysis.operators.curvatures`), recorded in
the settings; ``--products`` chooses how Hessian products are computed.

An output folder holds one analysis: :func:`run_hessian` refuses, before any work, a folder whose ``hessian.json``
was computed with other settings (:func:`check_earlier_analysis`; ``replace=True`` replaces it), and goes on over one
of the same settings (of the same or of new weights) as a fresh start.
"""
from __future__ import annotations

import io
import math
import time
from pathlib import Path

import torch

from ...errors import ConfigError
from ..estimators.quantities import QUANTITY_SEED_OFFSET, measure_record, quantity, recorded_names
from ..estimators.registry import DEFAULT_DENSITY_METHOD, DEFAULT_WHICH, estimator
from .hessian_settings import BEFORE_RECORDED, HessianSettings, damping_text, measured_text
from ..operators.names import CURVATURE_TITLES
from ...utils import ranks
from ...utils.io import json_safe
from ...utils.lock import locks_output
from ..operators.distributed import over_ranks
from ..estimators.per_layer import layer_sizes
from .progress import PhasedProgress, phase_bounds
from .skeleton import AnalysisCommand, check_out_folder, progress_bar, versions, weights_digest, write_result
from ..estimators.by_name import estimate_density, estimate_eigenvalues, estimate_trace
from .result_figures import hessian_figures
from ..operators.combined import damped
from ..operators.linear_operator import CurvatureOperator, as_operator
from ..operators.curvatures import curvature_operator
from .result_files import MAX_MAGNITUDE, ResultFileError, first_out_of_range, read_hessian_file
from ..estimators.eigenvector_file import EIGENVECTOR_FORMAT, EigenvectorFile, load_eigenvectors

__all__ = ["run_hessian", "compute", "write_outputs", "load_eigenvectors", "EigenvectorFile", "weights_digest",
           "settings_record", "eigenvalue_ratio", "check_earlier_analysis", "samples_record", "measure_quantities"]

OUTPUT_NAMES = ("eigenvalues.png", "eigenvalues.pdf", "density.png", "density.pdf", "eigenvalues.csv",
                "eigenvectors.pt", "per_layer.csv", "per_layer.png", "per_layer.pdf")


# ---------------------------------------------------------------------------------------------- computing
def compute(op: CurvatureOperator, settings: HessianSettings = HessianSettings(), *, keep_vectors: bool = False,
            on_phase=None):
    """Run the estimators ``settings`` ask for on ``op`` (any operator: a user's model without a checkpoint too);
    returns ``(report, eigen_result, density_result)``. Only what is computed is read of ``settings``: not where
    the model and its data come from.

    The eigenvalues are those ``settings.which`` asks for (``settings.resolved_which``). The trace estimator is
    ``settings.resolved_trace_method`` (the eigenvalue method's own when none is given: power iteration runs
    PyHessian's whole protocol, docs/update-rules.md §21). Each estimator gets its own seed stream: ``seed`` for the
    eigenvalues, ``seed + 1`` for the trace, ``seed + 2`` for the density.
    ``on_phase(name)``: called as each phase begins (:mod:`flatfl.analysis.commands.progress`).
    """
    phase = on_phase or (lambda name: None)
    s = settings.validate()
    curvature = as_operator(op, "the Hessian analysis")
    op = damped(curvature, s.damping)  # the curvature + damping * I
    check_counts(s, op.dim)
    start = time.perf_counter()
    report: dict = {}
    eig = dens = None
    if s.top > 0:
        phase("top eigenvalues")
        # flatfl's Lanczos keeps the quadrature of its own start for the density: one SLQ start fewer to compute
        eig = estimate_eigenvalues(op, s.method, s.top, which=s.which, tol=s.tol, seed=s.seed,
                                   return_vectors=keep_vectors, exact_residuals=s.exact_residuals,
                                   quadrature_steps=s.density_steps if s.density else None)
        report["top_eigenvalues"] = eig.eigenvalues.tolist()
        report["residuals"] = eig.residuals.tolist()
        report["error_estimates"] = None if eig.error_bounds is None else eig.error_bounds.tolist()
        report["converged"] = eig.converged.tolist()
        kind = "explicit" if s.exact_residuals else (eig.residual_kind or s.eigen.residuals)
        report["eigen"] = {"method": eig.method, "hvps": eig.hvps, "tol": s.tol, "residual_kind": kind,
                           **json_safe(eig.info)}
        # lambda_1 / lambda_5 is a ratio of the largest eigenvalues (FedSAM, FedGloSS): none for the others
        largest = eig.info.get("which", s.resolved_which) == DEFAULT_WHICH
        report["eigenvalue_ratio"] = eigenvalue_ratio(report["top_eigenvalues"]) if largest else None
    else:
        report["top_eigenvalues"], report["residuals"], report["converged"] = [], [], []
        report["error_estimates"] = None
        report["eigen"] = None
        report["eigenvalue_ratio"] = None
    report["smallest_eigenvalues"] = smallest_eigenvalues(op, s, phase) if s.smallest else None
    if s.trace:
        phase("trace")
        report["trace"] = damped_trace(curvature, s)
    else:
        report["trace"] = None
    if s.density:
        phase("density")
        given = [eig.quadrature] if eig is not None and eig.quadrature is not None else []
        dens = estimate_density(op, DEFAULT_DENSITY_METHOD, steps=s.density_steps, starts=s.density_starts,
                                seed=s.seed + 2, given=given)
        report["density"] = json_safe(dens.as_dict())
    else:
        report["density"] = None
    if s.per_layer:
        from ..estimators.per_layer import per_layer_curvature

        exact = {"trace_method": "exact"} if s.trace and s.resolved_trace_method == "exact" else {}  # the blocks too
        # each block of the curvature, then moved by the damping exactly (as the whole trace is: no identity's noise)
        layers = per_layer_curvature(curvature, s.per_layer_top, tol=s.tol, trace_hvps=s.trace_hvps,
                                     trace_rtol=s.trace_rtol, seed=s.seed + 3,
                                     on_block=lambda i: phase("per-layer block"), **exact)
        report["per_layer"] = damped_layers(json_safe(layers.as_dict()), s.damping)
    report["quantities"] = measure_quantities(op, s, phase) if s.quantities else None
    report["hvps_total"] = int(op.hvps)
    if op.products is not None:  # a model's curvature: how its products were computed
        error = op.product_error
        report["products"] = {"method": op.products, "exact": op.products != "finite-difference",
                              "relative_error": None if error is None else float(error)}
    # where the random vectors were drawn (a generator on the operator's device, seeded from seed + 0 ... seed + 5)
    report["random_draws"] = {"seed": int(s.seed), "device": torch.device(op.device).type}
    report["seconds"] = time.perf_counter() - start
    check_recordable(report)
    return report, eig, dens


def damped_trace(curvature: CurvatureOperator, s: HessianSettings) -> dict:
    """hessian.json's ``trace`` of the curvature + ``s.damping`` I: the curvature's trace, estimated (its standard
    error and products are the curvature's), plus ``damping * dim``, exactly (``damping_added``)."""
    tr = estimate_trace(curvature, s.resolved_trace_method, max_hvps=s.trace_hvps, rtol=s.trace_rtol,
                        seed=s.seed + 1)
    record = json_safe(tr.as_dict())
    if s.damping:  # its target, products and standard error stay the estimate's of the curvature's trace
        added = s.damping * curvature.dim
        record.update(estimate=record["estimate"] + added, damping_added=added)
        if isinstance(record.get("per_parameter"), dict):  # the exact trace's shares, in layout order, each moved
            record["per_parameter"] = {n: v + s.damping * math.prod(shape)  # by its size
                                       for (n, v), shape in zip(record["per_parameter"].items(),
                                                                curvature.param_shapes)}
    return record


def damped_layers(layers: dict, damping: float) -> dict:
    """hessian.json's ``per_layer`` of the curvature + ``damping`` I from the curvature's: each block's eigenvalues
    moved up by ``damping`` and its trace by ``damping`` times its size, exactly (``damping``); residuals and
    standard errors are the curvature's (a shift changes neither)."""
    if not damping:
        return layers
    blocks = [dict(b, top_eigenvalues=[v + damping for v in b["top_eigenvalues"]], trace=b["trace"] + damping * b["dim"])
              for b in layers["blocks"]]
    return dict(layers, blocks=blocks, trace_sum=sum(b["trace"] for b in blocks), damping=damping)


def check_recordable(report: dict) -> None:
    """Every number of ``report`` that readers compute with is one a result file can hold (finite, within
    +-:data:`~flatfl.analysis.commands.result_files.MAX_MAGNITUDE`: flatfl refuses to read others): a ConfigError
    line naming the first that is not, before anything is written."""
    bad = first_out_of_range(report)
    if bad is not None:
        field, value = bad
        raise ConfigError(f"the analysis gave {value!r} in its {field} (a damping, a quantity or a loss this large?), "
                          f"beyond what a result file holds (+-{MAX_MAGNITUDE:g}); nothing was written")


def measure_quantities(op: CurvatureOperator, s: HessianSettings, phase=lambda name: None) -> dict:
    """hessian.json's ``quantities``: each registered quantity ``s.measure`` names, by name, as its function
    records it (estimate, standard error, products spent; :mod:`flatfl.analysis.estimators.quantities`), every one
    from the same seed stream (``seed + 5``), whichever others run."""
    out = {}
    for name in s.quantities:
        entry = quantity(name)
        phase(entry.title)
        out[name] = json_safe(entry.measure(op, s, s.seed + QUANTITY_SEED_OFFSET))
    return out


def check_counts(s: HessianSettings, dim: int) -> None:
    """The eigenvalues asked for (``--top``, ``--smallest``) are at most the operator's ``dim`` (ConfigError)."""
    for flag, k in (("--top", s.top), ("--smallest", s.smallest)):
        if k > dim:
            raise ConfigError(f"{flag} {k} is larger than the number of parameters ({dim})")


def smallest_eigenvalues(op: CurvatureOperator, s: HessianSettings, phase=lambda name: None) -> dict:
    """hessian.json's ``smallest_eigenvalues``: the ``s.smallest`` smallest (most negative) eigenvalues, ascending,
    by ``s.smallest_method`` at ``s.tol`` from their own seed stream (``seed + 4``), with the residuals and error
    estimates of the top eigenvalues'."""
    phase("smallest eigenvalues")
    low = estimate_eigenvalues(op, s.smallest_method, s.smallest, which="smallest", tol=s.tol, seed=s.seed + 4,
                               exact_residuals=s.exact_residuals)
    return {"values": low.eigenvalues.tolist(), "residuals": low.residuals.tolist(),
            "error_estimates": None if low.error_bounds is None else low.error_bounds.tolist(),
            "converged": low.converged.tolist(), "method": low.method, "tol": s.tol, "hvps": low.hvps,
            "rounding_floor": low.info.get("rounding_floor")}


#: the ratio of the top eigenvalues reported: lambda_1 / lambda_RATIO_K, when at least RATIO_K are computed
RATIO_K = 5


def eigenvalue_ratio(values) -> dict | None:
    """``{"k": 5, "value": lambda_1 / lambda_5}`` (the FedSAM and FedGloSS papers' ratio) when at least
    :data:`RATIO_K` eigenvalues were computed and lambda_5 is not zero; else None."""
    if len(values) < RATIO_K or values[RATIO_K - 1] == 0:
        return None
    return {"k": RATIO_K, "value": float(values[0]) / float(values[RATIO_K - 1])}


# ---------------------------------------------------------------------------------------------- writing
def _eigenvalues_csv(report: dict) -> str:
    lines = ["index,eigenvalue,residual,error_estimate,converged"]
    estimates = report.get("error_estimates") or [None] * len(report["top_eigenvalues"])
    rows = zip(report["top_eigenvalues"], report["residuals"], estimates, report["converged"])
    for i, (lam, res, est, ok) in enumerate(rows, 1):
        lines.append(f"{i},{lam!r},{'' if res is None else repr(res)},{'' if est is None else repr(est)},"
                     f"{str(bool(ok)).lower()}")
    return "\n".join(lines) + "\n"


def write_outputs(out, report: dict, eig=None, dens=None, op=None, save_eigenvectors: bool = False,
                  title: str = "") -> list[Path]:
    """Render everything in memory, then write each file atomically into ``out`` (``hessian.json`` last)."""
    out = check_out_folder(out)
    if not report.get("per_layer"):  # an earlier --per-layer of these weights: kept, its files written again
        earlier = _previous_clients_section(out / "hessian.json", report.get("checkpoint"),
                                            report.get("weights_sha256"), refuse_other=True, key="per_layer")
        if earlier is not None:  # marked, with the settings it was computed with (its samples, seed...)
            kept = {"settings": (read_hessian_file(out / "hessian.json") or {}).get("settings")}
            report = dict(report, per_layer=dict(earlier, kept_from_earlier_analysis=kept))
    figures = hessian_figures(report, title)
    if report.get("per_layer"):
        from ..estimators.per_layer import per_layer_csv, per_layer_figure

        for fmt in ("png", "pdf"):
            matrix = CURVATURE_TITLES.get(report.get("curvature"), "Hessian") + \
                damping_text((report.get("settings") or {}).get("damping"))
            figures[f"per_layer.{fmt}"] = per_layer_figure(report["per_layer"], fmt, title, report, matrix)
    csv_text = _eigenvalues_csv(report) if report["top_eigenvalues"] else None
    vectors_payload = None
    if save_eigenvectors:
        if eig is None or eig.eigenvectors is None or op is None:
            raise ConfigError("--save-eigenvectors needs --top >= 1")
        vectors_payload = {
            "format": EIGENVECTOR_FORMAT,
            "eigenvalues": torch.as_tensor(eig.eigenvalues, dtype=torch.float64),
            "residuals": torch.as_tensor(eig.residuals, dtype=torch.float64),
            "vectors": eig.eigenvectors.detach().to("cpu", torch.float32).contiguous(),
            "param_names": list(op.param_names),
            "param_shapes": [list(s) for s in op.param_shapes],
            "checkpoint": report.get("checkpoint"),
            "round": report.get("round"),
            "weights_sha256": report.get("weights_sha256"),
        }
    layers_csv = per_layer_csv(report["per_layer"]) if report.get("per_layer") else None
    names = sorted(figures) + (["eigenvalues.csv"] if csv_text else []) + \
        (["per_layer.csv"] if layers_csv else []) + (["eigenvectors.pt"] if vectors_payload else []) + ["hessian.json"]
    report = dict(report, files=names)
    previous = _previous_clients_section(out / "hessian.json", report.get("checkpoint"), report.get("weights_sha256"),
                                         refuse_other=True)
    if previous is not None and "clients" not in report:
        report["clients"] = previous  # results of `flatfl hessian-clients` on the same checkpoint are kept
    files: dict = dict(sorted(figures.items()))
    if csv_text:
        files["eigenvalues.csv"] = csv_text
    if layers_csv:
        files["per_layer.csv"] = layers_csv
    if vectors_payload:
        buf = io.BytesIO()
        torch.save(vectors_payload, buf)
        files["eigenvectors.pt"] = buf.getvalue()
    files = write_result(out, files, "hessian.json", report)  # all or nothing
    from ...utils.manifest import remove_owned

    for name in OUTPUT_NAMES:  # outputs of an earlier run in the same folder that this run did not produce
        if name not in names and (out / name).is_file():
            remove_owned(out / name)  # only if flatfl wrote it: a user's file of the same name is kept
    return list(files)


def _previous_clients_section(path: Path, checkpoint, digest=None, refuse_other: bool = False,
                              key: str = "clients") -> dict | None:
    """The ``clients`` section (or ``key``: ``per_layer``) of an existing hessian.json for the same model (same
    weights digest; the same checkpoint path for files written before digests were recorded), if any. With
    ``refuse_other``, such a section of other weights (results that this write would drop) is a ConfigError."""
    try:
        old = read_hessian_file(path)
    except ResultFileError:
        return None  # not a flatfl hessian.json: replaced (refuse_foreign kept a user's own file)
    if old is None or not isinstance(old.get(key), dict):
        return None
    same = old.get("weights_sha256") == digest if digest and old.get("weights_sha256") else \
        old.get("checkpoint") == checkpoint
    if not same and refuse_other:
        what = "'flatfl hessian-clients' results" if key == "clients" else "per-layer results (per_layer.csv)"
        raise ConfigError(f"{path} holds {what} of other weights ({old.get('checkpoint')}, round {old.get('round')}); "
                          f"writing here would drop them: choose another --out")
    return old[key] if same else None


# ---------------------------------------------------------------------------------------------- the command
def settings_record(s: HessianSettings, device, precision: str = "float32") -> dict:
    """hessian.json's ``settings``: what made the numbers (the eigenvalues and the trace method as they ran, the
    device resolved, the floating type the products ran in)."""
    return {"top": s.top, "which": s.resolved_which, "method": s.method, "tol": s.tol, "trace": s.trace,
            "trace_method": s.resolved_trace_method,
            "trace_hvps": s.trace_hvps, "trace_rtol": s.trace_rtol, "density": s.density,
            "density_steps": s.density_steps, "density_starts": s.density_starts, "samples": s.samples,
            "batch_size": s.batch_size, "split": s.split, "seed": s.seed, "device": str(device), "mode": "eval",
            "save_eigenvectors": s.save_eigenvectors, "exact_residuals": s.exact_residuals,
            "per_layer": s.per_layer, "per_layer_top": s.per_layer_top, "loss": s.loss, "curvature": s.curvature,
            "products": s.products, "precision": precision, "smallest": s.smallest,
            "measure": measure_record(s.measure), "damping": s.damping + 0.0}  # + 0.0: -0.0 recorded as 0.0


#: settings that do not change what an analysis computes: where it ran, how its samples were cut into batches
SAME_RESULT = ("device", "batch_size")
#: settings that only add outputs, compared apart (:func:`check_earlier_analysis`)
ADDED_OUTPUTS = ("save_eigenvectors", "per_layer", "per_layer_top", "measure")


def _what_it_computed(record: dict) -> dict:
    """The settings of a hessian.json that decide its numbers: those of an estimator that did not run (no top
    eigenvalues, no trace, no density) dropped, the device and batch size left out (:data:`SAME_RESULT`)."""
    out = {k: v for k, v in record.items() if k not in SAME_RESULT + ADDED_OUTPUTS}
    if not record.get("top"):
        out.pop("which", None)
        if not record.get("smallest"):
            for k in ("tol", "exact_residuals"):
                out.pop(k, None)
    if not record.get("trace"):  # a measured quantity may spend the trace's budget: its settings kept then
        for k in ("trace_method",) if record.get("measure") else ("trace_method", "trace_hvps", "trace_rtol"):
            out.pop(k, None)
    if not record.get("density"):
        for k in ("density_steps", "density_starts"):
            out.pop(k, None)
    return out


def _recorded_which(saved: dict):
    """The eigenvalues an earlier hessian.json holds: its ``which``, or for a file written before it was recorded
    its method's own (lanczos: the largest; power: the largest in magnitude); None when unknown."""
    if saved.get("which") is not None:
        return saved["which"]
    try:
        return estimator("eigenvalues", saved.get("method", "lanczos")).which[0]
    except Exception:  # noqa: BLE001 - a method no longer registered: not compared
        return None


def check_earlier_analysis(out: Path, record: dict, *, replace: bool = False) -> None:
    """Refuse to write over an analysis in ``out`` computed with other settings than ``record`` (this analysis'
    hessian.json ``settings``): one ConfigError line naming the folder, what differs and another folder to use. An
    analysis of the same settings (of the same or other weights) is replaced as a fresh start; so is one whose
    only difference adds outputs (``--save-eigenvectors``, ``--per-layer``, more ``--measure`` quantities), unless this
    analysis would drop them (eigenvectors.pt, a measured quantity; per-layer results with another
    ``--per-layer-top``: those without --per-layer are kept). A
    hessian.json flatfl cannot read is left to the output checks. ``replace=True`` replaces whatever is there."""
    try:
        old = read_hessian_file(out / "hessian.json")
    except ResultFileError:
        return
    if replace or not old or not isinstance(old.get("settings"), dict):
        return
    saved = {**old["settings"], "which": _recorded_which(old["settings"])}
    if saved["which"] is None:
        del saved["which"]
    before, now = _what_it_computed(saved), _what_it_computed(record)
    differ = []
    for key, value in now.items():
        if key not in before and key not in BEFORE_RECORDED:
            continue  # a setting the earlier file did not record: not compared
        was = before[key] if key in before else BEFORE_RECORDED[key]
        if was != value:
            differ.append((key, was, value))
    if saved.get("save_eigenvectors") and not record.get("save_eigenvectors"):
        differ.append(("save_eigenvectors", True, False))
    if set(recorded_names(saved.get("measure"))) - set(recorded_names(record.get("measure"))):  # more adds outputs
        differ.append(("measure", saved.get("measure"), record.get("measure")))
    if saved.get("per_layer") and record.get("per_layer") and saved.get("per_layer_top") != record.get("per_layer_top"):
        differ.append(("per_layer_top", saved.get("per_layer_top"), record.get("per_layer_top")))
    if not differ:
        return
    shown = "; ".join(f"--{k.replace('_', '-')} {_flag_value(was)} there, {_flag_value(v)} here"
                      for k, was, v in differ[:4])
    more = f"; {len(differ) - 4} more" if len(differ) > 4 else ""
    raise ConfigError(f"{out} holds an earlier analysis with other settings ({shown}{more}): writing here would "
                      f"replace it; choose another --out (e.g. --out {_free_folder(out)}), or remove "
                      f"{out / 'hessian.json'}")


def _flag_value(value) -> str:
    """A setting as the command line writes it: true/false, none, the value."""
    if isinstance(value, bool):
        return str(value).lower()
    return "none" if value is None else str(value)


def _free_folder(out: Path) -> Path:
    """``out-2``, ``out-3``...: the first sibling of ``out`` that does not exist."""
    i = 2
    while out.with_name(f"{out.name}-{i}").exists():
        i += 1
    return out.with_name(f"{out.name}-{i}")


def samples_record(asked: int | None, used: int, split: str) -> dict:
    """hessian.json's ``samples``: how many evaluation samples were ``asked`` for (None: the whole split) and
    ``used``, and a ``note`` when fewer were used than asked (the split holds fewer: all of them were used)."""
    record = {"asked": asked, "used": int(used), "split": split}
    if asked is not None and used < asked:
        record["note"] = f"{used:,} of the {asked:,} asked: the {split} split holds {used:,}, all of them were used"
    return record


@locks_output
def run_hessian(checkpoint, out, settings: HessianSettings = HessianSettings(), *, quiet: bool = False,
                replace: bool = False) -> dict:
    """What ``flatfl hessian`` does: load ``checkpoint``, compute what ``settings`` ask for, write it into ``out``;
    returns the report. An analysis in ``out`` with other settings is refused before any work
    (:func:`check_earlier_analysis`); ``replace=True`` replaces it."""
    s = settings.validate()
    loss = None
    if s.loss is not None:
        from ..operators.objective import load_loss

        loss = load_loss(s.loss)  # the named module only, imported before any work
    cmd = AnalysisCommand.open(checkpoint, out, device=s.device, outputs=OUTPUT_NAMES + ("hessian.json",),
                               data_dir=s.data_dir, model_factory=s.model_factory, precision=s.precision)
    out, ckpt, dev = cmd.out, cmd.checkpoint, cmd.device
    record = settings_record(s, dev, ckpt.precision)
    check_earlier_analysis(out, record, replace=replace)  # an earlier analysis with other settings is kept
    # refused before any work: hessian-clients results of other weights in --out would be dropped
    digest = weights_digest(ckpt.model)  # the weights are not changed by the analysis
    _previous_clients_section(out / "hessian.json", str(ckpt.path), digest, refuse_other=True)
    if not s.per_layer:  # nor per-layer results of other weights, which a run without --per-layer would drop
        _previous_clients_section(out / "hessian.json", str(ckpt.path), digest, refuse_other=True, key="per_layer")
    batches = ckpt.eval_batches(split=s.split, samples=s.samples, batch_size=s.batch_size, seed=s.seed)
    # under torchrun: this rank's shard of the evaluation set, its products all-reduced
    op = over_ranks(lambda shard: curvature_operator(s.curvature, ckpt.model, shard, mode="eval", loss=loss,
                                                     products=s.products), batches, objective=loss is not None,
                    world=cmd.world)
    check_counts(s, op.dim)  # before the progress bar (compute() checks again, for callers of its own)

    with progress_bar(quiet, desc="Hessian-vector products", unit="HVP") as bar:
        progress = PhasedProgress(bar, phase_bounds(s, op.dim, layer_sizes(op) if s.per_layer else None))
        op.on_hvp = progress.update
        try:
            report, eig, dens = compute(op, s, keep_vectors=s.save_eigenvectors, on_phase=progress.next_phase)
        finally:
            op.on_hvp = None
    loss = op.loss()
    op.release()
    if weights_digest(ckpt.model) != digest:  # a loss that changed the weights: the Hessian of other weights
        raise ConfigError(f"the model's weights changed during the analysis{f' (--loss {s.loss})' if s.loss else ''}"
                          ": a loss must not modify the model's parameters or buffers; nothing was written")

    header = {
        **cmd.header(digest=digest, num_params=op.dim),
        "curvature": s.curvature,
        "measured": measured_text(s.curvature, report.get("products"), ckpt.precision, s.damping),
        "num_samples": op.num_samples,
        "samples": samples_record(s.samples, op.num_samples, s.split),
        "loss": loss,
        "settings": record,
        "distributed": ranks.record(),
        **versions(),
    }
    report = {**header, **report}
    cmd.run_writer(write_outputs, out, report, eig, dens, op, save_eigenvectors=s.save_eigenvectors, title=cmd.title)
    return report
