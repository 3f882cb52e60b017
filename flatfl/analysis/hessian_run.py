"""What ``flatfl hessian`` does: checkpoint in; ``hessian.json``, ``eigenvalues.csv`` and figures out.

* :func:`analyse` runs the requested estimators on any operator and returns a JSON-ready report (plus the raw
  results), so it works on user models without a checkpoint.
* :func:`write_outputs` renders the figures in memory and only then writes every file atomically (one file at a
  time with :mod:`flatfl.utils.io`, ``hessian.json`` last): a failure while computing leaves no output at all.
* :func:`run_hessian` validates the settings, loads the checkpoint and its evaluation set, and chains the two.

Outputs in ``--out DIR``: ``hessian.json`` (eigenvalues with residuals ``||Hv - lambda v||``, error estimates
``min(r, r^2 / gap)`` and converged flags; trace with standard error; SLQ nodes and weights; HVP counts, seconds,
settings, checkpoint path, round, parameter count), ``eigenvalues.csv``, ``eigenvalues.png/.pdf`` (top-k curve, as
MAN Fig. 4a; when k >= 2), ``density.png/.pdf`` (spectral density on a log axis, as MAN Fig. 4b; with
``--density``), and ``eigenvectors.pt`` with ``--save-eigenvectors`` (read it with :func:`load_eigenvectors`).
"""
from __future__ import annotations

import io
import json
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError, ConfigError
from ..utils.device import resolve_device
from ..utils.lock import locks_output
from ..utils.io import atomic_write_many, json_safe
from .density import smoothed_density, spectral_density
from .eigen import power_iteration, top_eigenvalues
from .operator import HessianOperator
from .trace import estimate_trace
from ..utils.hessian_settings import METHODS, HessianSettings

__all__ = ["run_hessian", "analyse", "write_outputs", "load_eigenvectors", "EigenvectorFile", "METHODS"]

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
    reproduces PyHessian's whole protocol (spec/algorithms.md §21). Each estimator gets its own seed stream.
    """
    if top > op.dim:
        raise ConfigError(f"--top {top} is larger than the number of parameters ({op.dim})")
    if trace_method is None:
        trace_method = "pyhessian" if method == "power" else "hutchpp"
    start = time.perf_counter()
    report: dict = {}
    eig = dens = None
    if top > 0:
        if method == "power":
            eig = power_iteration(op, top, max_iter=100, tol=tol, seed=seed, return_vectors=keep_vectors).sorted()
        else:
            eig = top_eigenvalues(op, top, tol=tol, seed=seed, return_vectors=keep_vectors,
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
    report["seconds"] = time.perf_counter() - start
    return report, eig, dens


# ---------------------------------------------------------------------------------------------- writing
def _figure_bytes(draw, fmt: str) -> bytes:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0, 3.6), dpi=150)
    ax = fig.add_subplot(1, 1, 1)
    draw(ax)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt)
    return buf.getvalue()


def _render_figures(report: dict, dens, title: str) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    values = report["top_eigenvalues"]
    if len(values) >= 2:
        def draw_eigenvalues(ax):
            ax.plot(np.arange(1, len(values) + 1), values, marker="o" if len(values) <= 50 else None,
                    markersize=3, linewidth=1.2)
            ax.set_xlabel("Index")
            ax.set_ylabel("Eigenvalue")
            ax.set_title(f"Top {len(values)} Hessian eigenvalues: {title}", fontsize=9)
            ax.grid(alpha=0.3)

        for fmt in ("png", "pdf"):
            files[f"eigenvalues.{fmt}"] = _figure_bytes(draw_eigenvalues, fmt)
    if dens is not None:
        grid, curve = smoothed_density(dens.nodes, dens.weights)

        def draw_density(ax):
            ax.semilogy(grid, curve + 1e-7, linewidth=1.0)
            ax.set_xlabel("Eigenvalue")
            ax.set_ylabel("Density (log scale)")
            ax.set_title(f"Hessian eigenvalue spectral density: {title}", fontsize=9)
            nodes = np.concatenate(dens.nodes)
            ax.set_xlim(nodes.min() - 1, nodes.max() + 1)

        for fmt in ("png", "pdf"):
            files[f"density.{fmt}"] = _figure_bytes(draw_density, fmt)
    return files


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
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    figures = _render_figures(report, dens, title)
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
    out.mkdir(parents=True, exist_ok=True)
    files: dict = {out / name: data for name, data in sorted(figures.items())}
    if csv_text:
        files[out / "eigenvalues.csv"] = csv_text
    if vectors_payload:
        buf = io.BytesIO()
        torch.save(vectors_payload, buf)
        files[out / "eigenvectors.pt"] = buf.getvalue()
    files[out / "hessian.json"] = json.dumps(json_safe(report), indent=2, default=str) + "\n"
    atomic_write_many(files)  # all or nothing: a full disk leaves the folder as it was
    from ..utils.manifest import remove_owned

    for name in OUTPUT_NAMES:  # outputs of an earlier run in the same folder that this run did not produce
        if name not in names and (out / name).is_file():
            remove_owned(out / name)  # only if flatfl wrote it: a user's file of the same name is kept
    return list(files)


def _previous_clients_section(path: Path, checkpoint, digest=None, refuse_other: bool = False) -> dict | None:
    """The ``clients`` section of an existing hessian.json for the same model (same weights digest; the same
    checkpoint path for files written before digests were recorded), if any. With ``refuse_other``, a ``clients``
    section of other weights (``flatfl hessian-clients`` results that this write would drop) is a ConfigError."""
    import json

    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(old, dict) or not isinstance(old.get("clients"), dict):
        return None
    same = old.get("weights_sha256") == digest if digest and old.get("weights_sha256") else \
        old.get("checkpoint") == checkpoint
    if not same and refuse_other:
        raise ConfigError(f"{path} holds 'flatfl hessian-clients' results of other weights ({old.get('checkpoint')}, "
                          f"round {old.get('round')}); writing here would drop them: choose another --out")
    return old["clients"] if same else None


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of a model's parameters and buffers (names, shapes and values): what a derived result came from."""
    import hashlib

    h = hashlib.sha256()
    for name, t in list(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.float().numpy().tobytes())
    return h.hexdigest()


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
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    dev = resolve_device(device)
    from ..utils.manifest import refuse_foreign

    refuse_foreign(out, OUTPUT_NAMES + ("hessian.json",))

    from ..checkpoint import load_checkpoint

    ckpt = load_checkpoint(checkpoint, device=dev, data_dir=data_dir, model_factory=model_factory)
    # refused before any work: hessian-clients results of other weights in --out would be dropped
    _previous_clients_section(out / "hessian.json", str(ckpt.path), weights_digest(ckpt.model), refuse_other=True)
    batches = ckpt.eval_batches(split=split, samples=samples, batch_size=batch_size, seed=seed)
    op = HessianOperator(ckpt.model, batches, mode="eval")
    if top > op.dim:
        raise ConfigError(f"--top {top} is larger than the number of parameters ({op.dim})")

    from tqdm.auto import tqdm

    bar = tqdm(desc="Hessian-vector products", unit="HVP", disable=quiet or not sys.stderr.isatty(), leave=False)
    op.on_hvp = bar.update
    try:
        report, eig, dens = analyse(
            op, top=top, method=method, tol=tol, trace=trace, trace_method=trace_method, trace_hvps=trace_hvps,
            trace_rtol=trace_rtol, density=density, density_steps=density_steps, density_starts=density_starts,
            seed=seed, keep_vectors=save_eigenvectors, exact_residuals=exact_residuals,
        )
    finally:
        bar.close()
        op.on_hvp = None
    loss = op.loss()
    op.release()

    from ..version import __version__

    header = {
        "checkpoint": str(ckpt.path),
        "round": ckpt.round,
        "weights_sha256": weights_digest(ckpt.model),
        "model": ckpt.model_spec.get("name"),
        "dataset": ckpt.dataset_name,
        "num_params": op.dim,
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
        "flatfl_version": __version__,
        "torch_version": torch.__version__,
    }
    report = {**header, **report}
    title = f"{ckpt.model_spec.get('name')}, round {ckpt.round}"
    write_outputs(out, report, eig, dens, op, save_eigenvectors=save_eigenvectors, title=title)
    return report
