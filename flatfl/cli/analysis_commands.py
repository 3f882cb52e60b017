"""``flatfl hessian``, ``hessian-clients`` and ``surface``: the analyses of a checkpoint. Their options' defaults
are the fields of the typed settings (:mod:`flatfl.analysis.commands.hessian_settings`, ...); the Hessian estimators' names,
labels and pairings come from the registry (:mod:`flatfl.analysis.estimators.registry`)."""
from __future__ import annotations

import functools

from pathlib import Path

import click

from ..analysis.commands.client_metrics_settings import PROTOCOLS, ClientMetricsSettings  # no torch: the defaults
from ..analysis.estimators.quantities import quantity, quantity_names
from ..analysis.estimators.registry import DEFAULT_TRACE_METHOD, WHICH, estimator, estimator_names
from ..analysis.commands.hessian_settings import (CURVATURE_NAMES, CURVATURES, PRODUCT_METHODS, HessianSettings,
                                                  damping_text, eigenvalues_text, measured_text)
from ..utils.precision import PRECISIONS
from ..analysis.commands.surface_settings import DIRECTION_KINDS, SurfaceSettings
from .common import LazyHelp, NameChoice, apply_threads, friendly_errors, threads_option

__all__ = ["hessian", "hessian_clients", "surface", "default_out"]


HESSIAN_DEFAULTS = HessianSettings()


def _trace_default_text() -> str:
    """'(default: hutchpp; pyhessian with --method power)': the trace method that runs when none is given."""
    pairs = "".join(f"; {estimator('eigenvalues', name).trace_method} with --method {name}"
                    for name in estimator_names("eigenvalues") if estimator("eigenvalues", name).trace_method)
    return f"(default: {DEFAULT_TRACE_METHOD}{pairs})"


def on_a_checkpoint(command: str, settings_type):
    """What every analysis command shares: ``--quiet`` and ``--threads``, errors as one line, the threads applied,
    the output folder resolved (``--out``, else the run's own folder for ``command``) and the command's options made
    into its one settings object (``settings_type``: one field per option, where the command line enters); the
    command gets ``checkpoint``, ``out``, ``where`` (a note for its last line when the folder was chosen for it),
    ``settings`` and ``quiet``."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(checkpoint, out, threads, quiet, **options):
            apply_threads(threads)
            out, where = _out_folder(checkpoint, out, command)
            return fn(checkpoint, out, where, settings_type(**options), quiet)
        return click.option("--quiet", is_flag=True, help="no progress bar")(threads_option(friendly_errors(run)))
    return wrap


def model_source_options(defaults):
    """``--device``, ``--data-dir`` and ``--model-factory``: where an analysis runs and how it rebuilds the
    checkpoint's model and data, with the analysis' own defaults."""
    options = (
        click.option("--device", default=defaults.device, show_default=True, help="cpu | cuda | cuda:N | mps"),
        click.option("--data-dir", default=defaults.data_dir,
                     help="dataset folder (default: the one recorded in the checkpoint)"),
        click.option("--model-factory", default=defaults.model_factory,
                     help="module:function or path/to/file.py:function building your own network (default: the one "
                     "the run recorded); only its weights are loaded"),
        click.option("--precision", type=NameChoice(PRECISIONS, kind="precision"), default=defaults.precision,
                     help="floating type of the model, data and every product: float32 | float64 (default: the "
                     "run's, float64 for a float64 run; float64 on a GPU is slow)"))

    def add(command):
        for option in reversed(options):
            command = option(command)
        return command
    return add


HESSIAN_EPILOG = """\b
Examples:
  flatfl hessian runs/x                                          # top eigenvalue + Hutch++ trace -> runs/x/hessian
  flatfl hessian runs/x --per-layer                              # also each module's block: per_layer.csv, figures
  flatfl hessian runs/x --top 200 --density --samples 4096 --out runs/x/hessian
  flatfl hessian runs/x --method power --samples 4096 --out h-pyh  # PyHessian's protocol (power + its trace rule)
  flatfl hessian runs/x --curvature ggn --top 5 --out runs/x/ggn   # the Gauss-Newton matrix's top 5 and trace
  flatfl hessian runs/x --which smallest --top 3 --out runs/x/neg   # the 3 most negative eigenvalues
  flatfl hessian runs/x --products finite-difference              # an operation torch cannot differentiate twice
  flatfl hessian runs/x --measure frobenius --out runs/x/frob      # also ||H||_F^2, the sum of squared eigenvalues
  flatfl hessian runs/x --damping 5e-4 --out runs/x/wd             # the Hessian of the loss + weight decay 5e-4
"""


DAMPING_HELP = ("measure the curvature + DAMPING * I instead: the Hessian of the loss plus (DAMPING/2) ||theta||^2 "
                "(weight decay), a damped Gauss-Newton matrix; every eigenvalue moves up by DAMPING, the trace by "
                "DAMPING times the parameter count")


def _target_missed(record: dict) -> str:
    """'; the target of 1% relative error was not reached in the budget (5.39% at 100 HVPs)' where an estimate
    (a trace, a measured quantity) stopped at its budget above its target, else ''."""
    target, relative, hvps = record.get("target_rtol"), record.get("relative_stderr"), record.get("hvps")
    if record.get("target_reached") is not False or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                            for v in (target, hvps)):
        return ""
    reached = f"{100 * relative:.3g}%" if isinstance(relative, (int, float)) and not isinstance(relative, bool) \
        else "no relative standard error"
    return f"; the target of {100 * target:.3g}% relative error was not reached in the budget ({reached} at {hvps} HVPs)"


@click.command(epilog=HESSIAN_EPILOG)
@click.argument("checkpoint", type=click.Path())
@click.option("--out", default=None, type=click.Path(), help="output directory (hessian.json, eigenvalues.csv, figures; default: the run's 'hessian' folder, e.g. RUN/hessian)")
@click.option("--top", type=int, default=HESSIAN_DEFAULTS.top, show_default=True, help="number of eigenvalues (0 = none), those --which names: by default the "
              "largest algebraic with --method lanczos, the largest in magnitude with --method power (they differ at "
              "saddles, where negative eigenvalues are large)")
@click.option("--which", type=NameChoice(tuple(WHICH), kind="choice of eigenvalues"), default=HESSIAN_DEFAULTS.which,
              help="largest | smallest | magnitude: the largest algebraic eigenvalues (descending), the smallest "
              "(ascending: the most negative first) or the largest in magnitude (default: largest with --method "
              "lanczos; power iteration finds the largest in magnitude only)")
@click.option("--smallest", type=int, default=HESSIAN_DEFAULTS.smallest, show_default=True,
              help="also the K smallest (most negative) eigenvalues, beside --top's, at --tol, by --method when it finds "
              "them, else Lanczos (hessian.json's smallest_eigenvalues; a report of runs that have them shows a "
              "smallest-eigenvalue column)")
@click.option("--trace/--no-trace", default=HESSIAN_DEFAULTS.trace, show_default=True, help="estimate the trace")
@click.option("--density/--no-density", default=HESSIAN_DEFAULTS.density, show_default=True, help="eigenvalue spectral density (SLQ)")
@click.option("--samples", type=int, default=HESSIAN_DEFAULTS.samples, help="draw N evaluation samples once with --seed (default: whole split)")
@click.option("--batch-size", type=int, default=HESSIAN_DEFAULTS.batch_size, show_default=True, help="evaluation batch size (does not change the result)")
@click.option("--split", default=HESSIAN_DEFAULTS.split, show_default=True, help="train | test")
@click.option("--method", default=HESSIAN_DEFAULTS.method, show_default=True, cls=LazyHelp,
              lazy_help=lambda: f"{' | '.join(estimator_names('eigenvalues'))} (power: PyHessian's rule)")
@click.option("--tol", type=float, default=HESSIAN_DEFAULTS.tol, show_default=True, help="eigenvalue tolerance (Lanczos: relative residual; power: relative change)")
@click.option("--trace-method", default=HESSIAN_DEFAULTS.trace_method, cls=LazyHelp,
              lazy_help=lambda: f"{' | '.join(estimator_names('trace'))} {_trace_default_text()}")
@click.option("--trace-hvps", type=int, default=HESSIAN_DEFAULTS.trace_hvps, show_default=True, help="HVP budget of the trace estimate")
@click.option("--trace-rtol", type=float, default=HESSIAN_DEFAULTS.trace_rtol, show_default=True, help="stop the trace at this relative standard error")
@click.option("--density-steps", type=int, default=HESSIAN_DEFAULTS.density_steps, show_default=True, help="Lanczos steps per SLQ start")
@click.option("--density-starts", type=int, default=HESSIAN_DEFAULTS.density_starts, show_default=True, help="number of SLQ starts")
@click.option("--seed", type=int, default=HESSIAN_DEFAULTS.seed, show_default=True, help="seed of the sample draw and of every random vector")
@model_source_options(HESSIAN_DEFAULTS)
@click.option("--save-eigenvectors", is_flag=True, default=HESSIAN_DEFAULTS.save_eigenvectors, help="also write eigenvectors.pt (parameter layout included)")
@click.option("--per-layer", is_flag=True, default=HESSIAN_DEFAULTS.per_layer, help="also each module's Hessian block (weights and bias together): its top eigenvalue(s) and trace +- standard error, in per_layer.csv, per_layer.png/.pdf and hessian.json")
@click.option("--per-layer-top", type=int, default=HESSIAN_DEFAULTS.per_layer_top, show_default=True, help="top eigenvalues per block with --per-layer")
@click.option("--loss", default=HESSIAN_DEFAULTS.loss, help="module:function or path/to/file.py:function, loss(model, batch) -> the batch's mean loss, instead of cross-entropy (batch: the (inputs, targets) pair); imported as --model-factory is")
@click.option("--exact-residuals", is_flag=True, default=HESSIAN_DEFAULTS.exact_residuals,
              help="recompute each residual ||Hv - lambda v|| with one more HVP (without it, Lanczos reports the "
              "residual of its recurrence: an estimate that can understate the true one by orders of magnitude)")
@click.option("--curvature", default=HESSIAN_DEFAULTS.curvature, show_default=True,
              help=f"{' | '.join(CURVATURES)}: the matrix measured: "
              + "; ".join(f"{kind.name}: {kind.description}" for kind in CURVATURES.values()))
@click.option("--products", default=HESSIAN_DEFAULTS.products,
              show_default=True, help=f"{' | '.join(PRODUCT_METHODS)}: how Hessian products are computed (auto: forward-over-reverse on CUDA, "
              "double backward elsewhere; finite-difference: two gradients per product, for operations torch cannot "
              "differentiate twice)")
@click.option("--damping", type=float, default=HESSIAN_DEFAULTS.damping, show_default=True, help=DAMPING_HELP)
@click.option("--measure", default=HESSIAN_DEFAULTS.measure, cls=LazyHelp, metavar="NAME[,NAME...]",
              lazy_help=lambda: "also these quantities of the matrix (hessian.json's quantities; a report of runs that "
              "have them shows a column for each): " + "; ".join(f"{n}: {quantity(n).description}"
                                                                for n in quantity_names()))
@on_a_checkpoint("hessian", HessianSettings)
def hessian(checkpoint, out, where, settings: HessianSettings, quiet: bool):
    """Top Hessian eigenvalues, trace and spectral density of a checkpoint's model (mean loss, eval mode)."""
    from ..analysis.commands.hessian_command import run_hessian

    report = run_hessian(checkpoint, out, settings, quiet=quiet)
    values = report["top_eigenvalues"]
    found = []
    curvature = report["settings"].get("curvature", "hessian")
    matrix = CURVATURE_NAMES[curvature] + damping_text(report["settings"].get("damping"))  # 'Hessian + 0.001 I'
    if values:
        shown = ", ".join(f"{v:.6g}" for v in values[:5]) + (" ..." if len(values) > 5 else "")
        eigen = report.get("eigen") or {}
        which = report["settings"]["which"]
        label = _which_label(report["settings"]["method"], which)
        ratio = report.get("eigenvalue_ratio")
        ratio_text = f"; lambda_1/lambda_{ratio['k']} = {ratio['value']:.6g}" if ratio else ""
        listed = "smallest eigenvalues" if which == "smallest" else "top eigenvalues"
        click.echo(f"{listed} of the {matrix}{f' ({label})' if label else ''}: {shown}{ratio_text}")
        errors = report.get("error_estimates") or [None]
        error = "" if errors[0] is None else f" +- {errors[0]:.2g}"
        found.append(f"{eigenvalues_text(which)} {values[0]:.6g}{error}"
                     f"{_multiplicity_note(eigen.get('multiplicity'))}")
    low = report.get("smallest_eigenvalues")
    if low:
        shown = ", ".join(f"{v:.6g}" for v in low["values"][:5]) + (" ..." if len(low["values"]) > 5 else "")
        click.echo(f"smallest eigenvalues of the {matrix} (smallest algebraic): {shown}")
        errors = low.get("error_estimates") or [None]
        found.append(f"smallest eigenvalue {low['values'][0]:.6g}"
                     + ("" if errors[0] is None else f" +- {errors[0]:.2g}"))
    if report["trace"]:
        tr = report["trace"]
        stderr = "n/a" if tr["stderr"] is None else f"{tr['stderr']:.3g}"
        how = (f"exact, a bound on its rounding; {tr.get('backward_passes')} backward passes"
               if tr["method"] == "exact" else f"{tr['method']}, {tr['hvps']} HVPs{_target_missed(tr)}")
        click.echo(f"trace: {tr['estimate']:.6g} +- {stderr} ({how})")
        found.append(f"trace {tr['estimate']:.6g} +- {stderr}")
    for name, record in (report.get("quantities") or {}).items():
        title = quantity(name).title
        stderr = "n/a" if record.get("stderr") is None else f"{record['stderr']:.3g}"
        click.echo(f"{title}: {record['estimate']:.6g} +- {stderr} ({record.get('method', name)}, "
                   f"{record['hvps']} HVPs{_target_missed(record)})")
        found.append(f"{title} {record['estimate']:.6g} +- {stderr}")
    if report.get("density"):
        found.append("spectral density")
    layers = report.get("per_layer")
    if layers:
        widest = max(layers["blocks"], key=lambda b: b["top_eigenvalues"][0] if b["top_eigenvalues"] else -1e300)
        click.echo(f"per layer ({len(layers['blocks'])} {layers['grouping']}s): largest top eigenvalue "
                   f"{widest['top_eigenvalues'][0]:.6g} ({widest['module']}); traces sum to "
                   f"{layers['trace_sum']:.6g} +- {layers['trace_sum_stderr']:.3g} -> {Path(out) / 'per_layer.csv'}")
        found.append("per-layer curvature")
    measured = report.get("measured") or measured_text(curvature, report.get("products"), report.get("precision"))
    click.echo(f"{measured}: {', '.join(found)} on {_samples_text(report)}; {report['hvps_total']} HVPs in "
               f"{report['seconds']:.1f} s -> {Path(out) / 'hessian.json'}{where}")


def _which_label(method: str, which: str) -> str:
    """Which eigenvalues a result line lists ('largest algebraic', 'smallest algebraic', 'largest magnitude'): the
    method's own label for its default, else the name of ``which``."""
    entry = estimator("eigenvalues", method)
    return entry.label if which == entry.which[0] and entry.label else WHICH[which]


def _samples_text(report: dict) -> str:
    """'128 samples', or where the split held fewer than asked '1,442 of the 4,000 samples asked (the whole train
    split)' (hessian.json's ``samples``)."""
    samples = report.get("samples") or {}
    used, asked = report.get("num_samples"), samples.get("asked")
    if isinstance(used, int) and isinstance(asked, int) and used < asked:
        return f"{used:,} of the {asked:,} samples asked (the whole {samples.get('split', 'evaluation')} split)"
    return f"{used} samples"


def _out_folder(checkpoint, out, command: str) -> tuple[str, str]:
    """``(folder, note)``: ``--out`` as given, or the run's own folder for ``command`` with a note saying so."""
    if out is not None:
        return out, ""
    return str(default_out(checkpoint, command)), " (no --out: the run's analysis folder)"


def default_out(checkpoint, command: str) -> Path:
    """Where ``command`` (``hessian``, ``hessian-clients``, ``surface``) writes when no ``--out`` is given: a fixed
    folder of the run the checkpoint belongs to (flatfl/run_layout.py, :func:`flatfl.run_layout.analysis_dir`). A run folder or
    its ``final.pt``: ``RUN/hessian`` (``RUN/surface``); ``final-clients-average.pt``: ``RUN/hessian-clients-average``;
    any other checkpoint (``RUN/checkpoints/round_0010.pt``, a file of its own): ``hessian-<its name>`` beside it in
    the run (in its folder). Files there that flatfl did not write are refused, never replaced."""
    from ..checkpoint import resolve_checkpoint_path
    from ..run_layout import CLIENTS_DIR, HESSIAN_DIR, MODEL_CHECKPOINTS, SURFACE_DIR, analysis_dir

    # flatfl hessian and hessian-clients share one folder (clients-<protocol>.json beside hessian.json)
    base = {"hessian": HESSIAN_DIR, "hessian-clients": CLIENTS_DIR, "surface": SURFACE_DIR}[command]
    path = resolve_checkpoint_path(checkpoint)
    run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    models = {name: model for model, name in MODEL_CHECKPOINTS.items()}
    folder = analysis_dir(base, models[path.name]) if path.name in models else f"{base}-{path.stem}"
    return run / folder


def _multiplicity_note(multiplicity) -> str:
    """`` (repeated: 5 x6, checked)`` when Lanczos saw coinciding eigenvalues (hessian.json's eigen.multiplicity)."""
    if not multiplicity or not multiplicity.get("clusters"):
        return ""
    shown = ", ".join(f"{c['value']:.6g} x{c['copies']}" for c in multiplicity["clusters"][:3])
    return f" (repeated: {shown}; {multiplicity['status']})"


# ------------------------------------------------------------------------------------------------ hessian-clients
CLIENTS_DEFAULTS = ClientMetricsSettings()
HESSIAN_CLIENTS_EPILOG = """\b
Examples:
  flatfl hessian-clients runs/x --out runs/x/hessian                 # global model on each client's data
  flatfl hessian-clients runs/x --protocol fedalign --out runs/x/hessian  # FedAlign's code: local models, K x K mean
Each protocol writes clients-<protocol>.json, so both live in one folder; the same protocol with other settings
is refused (choose another --out). The run must have been trained with --save-clients (clients.pt next to final.pt).
"""


@click.command("hessian-clients", epilog=HESSIAN_CLIENTS_EPILOG)
@click.argument("checkpoint", type=click.Path())
@click.option("--out", default=None, type=click.Path(), help="output directory (clients-<protocol>.json and its heat map; each protocol its own files; default: the run's 'hessian' folder)")
@click.option("--protocol", default=CLIENTS_DEFAULTS.protocol, show_default=True, help=f"{' | '.join(PROTOCOLS)} (fedalign: FedAlign's code, to reproduce its Table 1)")
@click.option("--probes", type=int, default=CLIENTS_DEFAULTS.probes, show_default=True, help="Rademacher probes per client (fedalign: the most, PyHessian's maxIter)")
@click.option("--groups", type=int, default=CLIENTS_DEFAULTS.groups, show_default=True, help="jackknife groups of probes for the standard errors")
@click.option("--samples", type=int, default=CLIENTS_DEFAULTS.samples, help="samples per client (default: all) | fedalign: global samples (default 640)")
@click.option("--batch-size", type=int, default=CLIENTS_DEFAULTS.batch_size, help="evaluation batch size (default 256; fedalign 64)")
@click.option("--tol", type=float, default=CLIENTS_DEFAULTS.tol, show_default=True, help="fedalign: PyHessian's relative stopping tolerance")
@click.option("--seed", type=int, default=CLIENTS_DEFAULTS.seed, show_default=True, help="seed of the sample draws and the probes")
@click.option("--curvature", default=CLIENTS_DEFAULTS.curvature, show_default=True, help=f"{' | '.join(CURVATURES)}: the matrix of every client (a curvature other than the Hessian writes files of its own, clients-<protocol>-<curvature>.json, which reports do not use)")
@model_source_options(CLIENTS_DEFAULTS)
@on_a_checkpoint("hessian-clients", ClientMetricsSettings)
def hessian_clients(checkpoint, out, where, settings: ClientMetricsSettings, quiet: bool):
    """Cross-client Hessian metrics H_N and H_D (FedAlign Eq. 3-4) with standard errors."""
    from ..analysis.commands.clients_command import run_client_metrics

    c = run_client_metrics(checkpoint, out, settings, quiet=quiet)

    def show(value, err):
        return "n/a" if value is None else f"{value:.6g} +- {'n/a' if err is None else f'{err:.3g}'}"

    curvature = (c.get("settings") or {}).get("curvature", "hessian")
    of = "" if curvature == "hessian" else f", of the {CURVATURE_NAMES[curvature]}"
    click.echo(f"protocol {c['protocol']} ({c['num_clients']} clients, {c['pairs']} pairs, {c['estimator']}{of})")
    click.echo(f"H_N: {show(c['H_N'], c['H_N_stderr'])}")
    click.echo(f"H_D: {show(c['H_D'], c['H_D_stderr'])}")
    click.echo(f"H_N {show(c['H_N'], c['H_N_stderr'])}, H_D {show(c['H_D'], c['H_D_stderr'])} "
               f"({c['protocol']} protocol, {c['num_clients']} clients); {c['hvps']} HVPs in {c['seconds']:.1f} s "
               f"-> {Path(out) / c['files'][-1]}{where}")


# --------------------------------------------------------------------------------------------------------- surface
SURFACE_DEFAULTS = SurfaceSettings()
SURFACE_EPILOG = """\b
Examples:
  flatfl surface runs/x --out runs/x/surface                          # random filter-normalised, 21 x 21, range 1
  flatfl surface runs/x --directions hessian --grid 41 --samples 2048 --workers 2 --out runs/x/surface-h
  flatfl surface runs/x --directions hessian --eigenvectors runs/x/hessian/eigenvectors.pt --out s
Killed? Run the same command again: finished grid points are kept in surface.npz and not recomputed.
"""


@click.command(epilog=SURFACE_EPILOG)
@click.argument("checkpoint", type=click.Path())
@click.option("--out", default=None, type=click.Path(), help="output directory (surface.npz/.csv/.json, figures; default: the run's 'surface' folder)")
@click.option("--directions", default=SURFACE_DEFAULTS.directions, show_default=True, help=f"{' | '.join(DIRECTION_KINDS)} (random: filter-normalised; hessian: top-2 eigenvectors)")
@click.option("--grid", type=int, default=SURFACE_DEFAULTS.grid, show_default=True, help="points per axis (linspace(-R, R, N))")
@click.option("--range", "range", type=float, default=SURFACE_DEFAULTS.range, show_default=True, help="half-width R of the square")
@click.option("--samples", type=int, default=SURFACE_DEFAULTS.samples, help="draw N evaluation samples once with --seed (default: whole split)")
@click.option("--workers", type=int, default=SURFACE_DEFAULTS.workers, show_default=True, help="local worker processes (CPU)")
@click.option("--batch-size", type=int, default=SURFACE_DEFAULTS.batch_size, show_default=True, help="evaluation batch size")
@click.option("--split", default=SURFACE_DEFAULTS.split, show_default=True, help="train | test")
@click.option("--seed", type=int, default=SURFACE_DEFAULTS.seed, show_default=True, help="seed of the sample draw and the random directions")
@click.option("--include-bn-bias", is_flag=True, default=SURFACE_DEFAULTS.include_bn_bias, help="random directions also move 1-D tensors (biases, norm affine)")
@click.option("--eigenvectors", type=click.Path(), default=SURFACE_DEFAULTS.eigenvectors, help="eigenvectors.pt from 'flatfl hessian --save-eigenvectors'")
@click.option("--tol", type=float, default=SURFACE_DEFAULTS.tol, show_default=True, help="Lanczos tolerance for --directions hessian")
@model_source_options(SURFACE_DEFAULTS)
@click.option("--force", is_flag=True, default=SURFACE_DEFAULTS.force, help="start over instead of resuming surface.npz in --out")
@on_a_checkpoint("surface", SurfaceSettings)
def surface(checkpoint, out, where, settings: SurfaceSettings, quiet: bool):
    """Loss and accuracy on a 2-D grid around a checkpoint's model (contour and 3-D figures)."""
    from ..analysis.commands.surface_command import run_surface

    report = run_surface(checkpoint, out, settings, quiet=quiet)
    origin = report["loss_at_origin"]
    shown = "" if origin is None else f", loss at origin {origin:.6g}"
    click.echo(f"loss min {report['loss_min']:.6g}, max {report['loss_max']:.6g}{shown}; {report['points']} points "
               f"({report['points_computed_now']} computed now) in {report['seconds']:.1f} s "
               f"-> {Path(out) / 'surface.json'}{where}")
