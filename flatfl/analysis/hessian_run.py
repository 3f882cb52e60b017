"""What ``flatfl hessian`` does: checkpoint in; ``hessian.json``, ``eigenvalues.csv`` and figures out.

* :func:`analyse` runs the requested estimators on any operator and returns a JSON-ready report (plus the raw
  results), so it works on user models without a checkpoint.
* :func:`write_outputs` renders the figures in memory and only then writes every file atomically (one file at a
  time with :mod:`flatfl.utils.io`, ``hessian.json`` last): a failure while computing leaves no output at all.
* :func:`run_hessian` validates the settings, loads the checkpoint and its evaluation set (the skeleton of
  :mod:`flatfl.analysis.command`), and chains the two. The estimators are chosen by name
  (:mod:`flatfl.analysis.estimators`); the figures are :func:`flatfl.analysis.figures.hessian_figures`; the file
  is read back with :func:`flatfl.analysis.result_files.read_hessian_file`.

Outputs in ``--out DIR``: ``hessian.json`` (eigenvalues with residuals ``||Hv - lambda v||``, error estimates
``min(r, r^2 / gap)`` and converged flags; trace with standard error; SLQ nodes and weights; HVP counts, seconds,
settings, checkpoint path, round, parameter count), ``eigenvalues.csv``, ``eigenvalues.png/.pdf`` (the top-k on a
log axis and each one's residual and error estimate; when k >= 2), ``density.png/.pdf`` (spectral density as MAN
Fig. 4b: every SLQ start averaged, Gaussian width stated, log axis from 1e-4 of the peak; with ``--density``), and ``eigenvectors.pt`` with ``--save-eigenvectors`` (read it with :func:`load_eigenvectors`).
"""
from __future__ import annotations

import io
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError, ConfigError
from ..utils.hessian_settings import METHODS, HessianSettings
from ..utils.io import json_safe
from ..utils.lock import locks_output
from .command import AnalysisCommand, check_out_folder, progress_bar, versions, weights_digest, write_result
from .density import spectral_density
from .estimators import estimate_eigenvalues, estimate_trace
from .figures import hessian_figures
from .operator import HessianOperator
from .result_files import ResultFileError, read_hessian_file

__all__ = ["run_hessian", "analyse", "write_outputs", "load_eigenvectors", "EigenvectorFile", "METHODS",
           "weights_digest"]

DEFAULTS = HessianSettings()  # every default below is one of its fields
EIGENVECTOR_FORMAT = "flatfl-eigenvectors"
OUTPUT_NAMES = ("eigenvalues.png", "eigenvalues.pdf", "density.png", "density.pdf", "eigenvalues.csv",
                "eigenvectors.pt")


# ---------------------------------------------------------------------------------------------- computing
def analyse(
    op,
    *,
    top: int = DEFAULTS.top,
    method: str = DEFAULTS.method,
    tol: float = DEFAULTS.tol,
    trace: bool = DEFAULTS.trace,
    trace_method: str | None = DEFAULTS.trace_method,
    trace_hvps: int = DEFAULTS.trace_hvps,
    trace_rtol: float | None = DEFAULTS.trace_rtol,
    density: bool = DEFAULTS.density,
    density_steps: int = DEFAULTS.density_steps,
    density_starts: int = DEFAULTS.density_starts,
    seed: int = DEFAULTS.seed,
    keep_vectors: bool = False,
    exact_residuals: bool = DEFAULTS.exact_residuals,
):
    """Run the requested estimators on ``op``; returns ``(report, eigen_result, density_result)``.

    ``trace_method`` defaults to ``hutchpp``, or to ``pyhessian`` with ``method="power"`` so that the power method
    reproduces PyHessian's whole protocol (docs/update-rules.md §21). Each estimator gets its own seed stream.
    """
    if top > op.dim:
        raise ConfigError(f"--top {top} is larger than the number of parameters ({op.dim})")
    if trace_method is None:
        trace_method = "pyhessian" if method == "power" else "hutchpp"
    start = time.perf_counter()
    report: dict = {}
    eig = dens = None
    if top > 0:
        eig = estimate_eigenvalues(op, method, top, tol=tol, seed=seed, return_vectors=keep_vectors,
                                   exact_residuals=exact_residuals)
        report["top_eigenvalues"] = eig.eigenvalues.tolist()
        report["residuals"] = eig.residuals.tolist()
        report["error_estimates"] = None if eig.error_bounds is None else eig.error_bounds.tolist()
        report["converged"] = eig.converged.tolist()
        kind = "lanczos relation" if eig.method == "lanczos" and not exact_residuals else "explicit"
        report["eigen"] = {"method": eig.method, "hvps": eig.hvps, "tol": tol, "residual_kind": kind,
                           **json_safe(eig.info)}
    else:
        report["top_eigenvalues"], report["residuals"], report["converged"] = [], [], []
        report["error_estimates"] = None
        report["eigen"] = None
    if trace:
        tr = estimate_trace(op, trace_method, max_hvps=trace_hvps, rtol=trace_rtol, seed=seed + 1)
        report["trace"] = json_safe(tr.as_dict())
    else:
        report["trace"] = None
    if density:
        dens = spectral_density(op, steps=density_steps, starts=density_starts, seed=seed + 2)
        report["density"] = json_safe(dens.as_dict())
    else:
        report["density"] = None
    report["hvps_total"] = int(getattr(op, "hvps", 0))
    # where the random vectors were drawn (a generator on the operator's device, seeded from seed, seed + 1, seed + 2)
    report["random_draws"] = {"seed": int(seed), "device": torch.device(op.device).type}
    report["seconds"] = time.perf_counter() - start
    return report, eig, dens


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
    figures = hessian_figures(report, title)
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
    names = sorted(figures) + (["eigenvalues.csv"] if csv_text else []) + \
        (["eigenvectors.pt"] if vectors_payload else []) + ["hessian.json"]
    report = dict(report, files=names)
    previous = _previous_clients_section(out / "hessian.json", report.get("checkpoint"), report.get("weights_sha256"),
                                         refuse_other=True)
    if previous is not None and "clients" not in report:
        report["clients"] = previous  # results of `flatfl hessian-clients` on the same checkpoint are kept
    files: dict = dict(sorted(figures.items()))
    if csv_text:
        files["eigenvalues.csv"] = csv_text
    if vectors_payload:
        buf = io.BytesIO()
        torch.save(vectors_payload, buf)
        files["eigenvectors.pt"] = buf.getvalue()
    files = write_result(out, files, "hessian.json", report)  # all or nothing
    from ..utils.manifest import remove_owned

    for name in OUTPUT_NAMES:  # outputs of an earlier run in the same folder that this run did not produce
        if name not in names and (out / name).is_file():
            remove_owned(out / name)  # only if flatfl wrote it: a user's file of the same name is kept
    return list(files)


def _previous_clients_section(path: Path, checkpoint, digest=None, refuse_other: bool = False) -> dict | None:
    """The ``clients`` section of an existing hessian.json for the same model (same weights digest; the same
    checkpoint path for files written before digests were recorded), if any. With ``refuse_other``, a ``clients``
    section of other weights (``flatfl hessian-clients`` results that this write would drop) is a ConfigError."""
    try:
        old = read_hessian_file(path)
    except ResultFileError:
        return None  # not a flatfl hessian.json: replaced (refuse_foreign kept a user's own file)
    if old is None or not isinstance(old.get("clients"), dict):
        return None
    same = old.get("weights_sha256") == digest if digest and old.get("weights_sha256") else \
        old.get("checkpoint") == checkpoint
    if not same and refuse_other:
        raise ConfigError(f"{path} holds 'flatfl hessian-clients' results of other weights ({old.get('checkpoint')}, "
                          f"round {old.get('round')}); writing here would drop them: choose another --out")
    return old["clients"] if same else None


@dataclass
class EigenvectorFile:
    """Saved Hessian eigenvectors: ``vectors`` (k, dim) float32 unit rows in the parameter layout below."""

    eigenvalues: torch.Tensor
    residuals: torch.Tensor
    vectors: torch.Tensor
    param_names: list[str]
    param_shapes: list[tuple[int, ...]]
    checkpoint: str | None
    round: int | None
    weights_sha256: str | None = None

    def as_parameters(self, i: int) -> "OrderedDict[str, torch.Tensor]":
        """Eigenvector ``i`` shaped like the model's parameters, keyed by parameter name."""
        out, offset = OrderedDict(), 0
        for name, shape in zip(self.param_names, self.param_shapes):
            size = int(np.prod(shape)) if shape else 1
            out[name] = self.vectors[i, offset:offset + size].view(shape)
            offset += size
        return out


def load_eigenvectors(path) -> EigenvectorFile:
    """Read an ``eigenvectors.pt`` written by ``flatfl hessian --save-eigenvectors``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"eigenvector file not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        raise CheckpointError(f"{path} is not a readable eigenvector file (corrupt or truncated)") from None
    if not isinstance(payload, dict) or payload.get("format") != EIGENVECTOR_FORMAT:
        raise CheckpointError(f"{path} is not a flatfl eigenvector file")
    return EigenvectorFile(
        eigenvalues=payload["eigenvalues"], residuals=payload["residuals"], vectors=payload["vectors"],
        param_names=list(payload["param_names"]), param_shapes=[tuple(s) for s in payload["param_shapes"]],
        checkpoint=payload.get("checkpoint"), round=payload.get("round"), weights_sha256=payload.get("weights_sha256"),
    )


# ---------------------------------------------------------------------------------------------- the command
@locks_output
def run_hessian(
    checkpoint,
    out,
    *,
    top: int = DEFAULTS.top,
    trace: bool = DEFAULTS.trace,
    density: bool = DEFAULTS.density,
    samples: int | None = DEFAULTS.samples,
    batch_size: int = DEFAULTS.batch_size,
    split: str = DEFAULTS.split,
    method: str = DEFAULTS.method,
    seed: int = DEFAULTS.seed,
    device: str = DEFAULTS.device,
    save_eigenvectors: bool = DEFAULTS.save_eigenvectors,
    tol: float = DEFAULTS.tol,
    trace_method: str | None = DEFAULTS.trace_method,
    trace_hvps: int = DEFAULTS.trace_hvps,
    trace_rtol: float | None = DEFAULTS.trace_rtol,
    density_steps: int = DEFAULTS.density_steps,
    density_starts: int = DEFAULTS.density_starts,
    exact_residuals: bool = DEFAULTS.exact_residuals,
    data_dir=DEFAULTS.data_dir,
    quiet: bool = False,
    model_factory: str | None = DEFAULTS.model_factory,
) -> dict:
    """Load ``checkpoint``, compute the requested Hessian quantities, write them into ``out``; returns the report."""
    HessianSettings(top=top, trace=trace, density=density, samples=samples, batch_size=batch_size, split=split,
                    method=method, seed=seed, device=device, save_eigenvectors=save_eigenvectors, tol=tol,
                    trace_method=trace_method, trace_hvps=trace_hvps, trace_rtol=trace_rtol,
                    density_steps=density_steps, density_starts=density_starts, exact_residuals=exact_residuals,
                    data_dir=data_dir, model_factory=model_factory).validate()
    cmd = AnalysisCommand.open(checkpoint, out, device=device, outputs=OUTPUT_NAMES + ("hessian.json",),
                               data_dir=data_dir, model_factory=model_factory)
    out, ckpt, dev = cmd.out, cmd.checkpoint, cmd.device
    # refused before any work: hessian-clients results of other weights in --out would be dropped
    digest = weights_digest(ckpt.model)  # the weights are not changed by the analysis
    _previous_clients_section(out / "hessian.json", str(ckpt.path), digest, refuse_other=True)
    batches = ckpt.eval_batches(split=split, samples=samples, batch_size=batch_size, seed=seed)
    op = HessianOperator(ckpt.model, batches, mode="eval")
    if top > op.dim:
        raise ConfigError(f"--top {top} is larger than the number of parameters ({op.dim})")

    with progress_bar(quiet, desc="Hessian-vector products", unit="HVP") as bar:
        op.on_hvp = bar.update
        try:
            report, eig, dens = analyse(
                op, top=top, method=method, tol=tol, trace=trace, trace_method=trace_method, trace_hvps=trace_hvps,
                trace_rtol=trace_rtol, density=density, density_steps=density_steps, density_starts=density_starts,
                seed=seed, keep_vectors=save_eigenvectors, exact_residuals=exact_residuals,
            )
        finally:
            op.on_hvp = None
    loss = op.loss()
    op.release()

    header = {
        **cmd.header(digest=digest, num_params=op.dim),
        "num_samples": op.num_samples,
        "loss": loss,
        "settings": {
            "top": top, "method": method, "tol": tol, "trace": trace,
            "trace_method": trace_method or ("pyhessian" if method == "power" else "hutchpp"),
            "trace_hvps": trace_hvps, "trace_rtol": trace_rtol, "density": density, "density_steps": density_steps,
            "density_starts": density_starts, "samples": samples, "batch_size": batch_size, "split": split,
            "seed": seed, "device": str(dev), "mode": "eval", "save_eigenvectors": save_eigenvectors,
            "exact_residuals": exact_residuals,
        },
        **versions(),
    }
    report = {**header, **report}
    write_outputs(out, report, eig, dens, op, save_eigenvectors=save_eigenvectors, title=cmd.title)
    return report
