"""The ``flatfl`` command line. Each command parses its options and calls one library function.

Errors caused by the user's input are :class:`flatfl.errors.FlatflError`; they are printed as one line
(``flatfl: error: ...``) with exit status 2, never as a traceback.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from .utils.startup import import_torch_uninterruptibly, install_interrupt_hook, settle_source_date_epoch

if os.path.basename(sys.argv[0] or "") == "flatfl":  # the console script: Ctrl-C while starting gives one line
    install_interrupt_hook()

import click  # noqa: E402

from .errors import FlatflError, error_line, unknown_name  # noqa: E402
from .utils.client_metrics_settings import PROTOCOLS, ClientMetricsSettings  # noqa: E402  (no torch: the defaults)
from .utils.hessian_settings import METHODS, TRACE_METHODS, HessianSettings, tracking_settings  # noqa: E402
from .utils.surface_settings import DIRECTION_KINDS, SurfaceSettings  # noqa: E402
from .paper_tables import DEFAULT_SEEDS, PRESETS, TARGETS  # noqa: E402  (no torch: the tables flatfl reproduce makes)


def friendly_errors(fn):
    """Turn FlatflError (and a few well-known OS errors) into one line on stderr and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FlatflError as e:
            click.echo(f"flatfl: error: {error_line(e)}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("flatfl: interrupted", err=True)
            sys.exit(130)
        except Exception as e:  # no traceback for the user: one line, exit 1 (FLATFL_DEBUG=1 shows it)
            if os.environ.get("FLATFL_DEBUG"):
                raise
            click.echo(f"flatfl: error: {error_line(describe_failure(e))}", err=True)
            sys.exit(2 if isinstance(e, (OSError, UnicodeDecodeError, ValueError)) else 1)

    return wrapper


def describe_failure(e: BaseException) -> str:
    """One line for an exception that is not a FlatflError (disk full, unreadable file, corrupt data...)."""
    import errno

    if isinstance(e, OSError):
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        if e.errno == errno.ENOSPC:
            return f"no space left on device{where}: nothing half-written was kept; free space and run again"
        return f"{e.strerror or type(e).__name__}{where}"
    if isinstance(e, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({e.reason} at byte {e.start})"
    text = " ".join(str(e).split())[:200]
    if isinstance(e, ValueError):
        return f"invalid data: {text or type(e).__name__}"
    return f"internal error {type(e).__name__}: {text} (set FLATFL_DEBUG=1 for the traceback)"


class FlatflGroup(click.Group):
    """click's group, with its usage errors (a bad flag value, an unknown option) also on one line."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        argv = sys.argv[1:] if args is None else list(args)
        try:
            if argv and not {"-h", "--help", "--version"} & set(argv):
                problem = settle_source_date_epoch()  # before numpy's f2py (read by scipy's import) sees it
                if problem:
                    click.echo(f"flatfl: error: {problem}", err=True)
                    sys.exit(2)
                import_torch_uninterruptibly()  # a command will run: torch first, Ctrl-C held back meanwhile
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except (click.exceptions.Abort, KeyboardInterrupt):
            click.echo("flatfl: interrupted", err=True)
            sys.exit(130)
        except click.ClickException as e:
            where = e.ctx.command_path if getattr(e, "ctx", None) is not None else "flatfl"
            hint = f" (see '{where} --help')" if isinstance(e, click.UsageError) else ""
            click.echo(f"flatfl: error: {error_line(' '.join(e.format_message().split()))}{hint}", err=True)
            sys.exit(e.exit_code)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=FlatflGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="flatfl")
def main() -> None:
    """flatfl: federated learning with flatness regularizers, and the curvature of what it learns."""


TRACKING = tracking_settings()  # the defaults of flatfl train --track-hessian
THREADS_HELP = ("torch threads, an integer >= 1 (default: 1 on machines with <= 2 cores, else the idle cores: "
                "cores minus the busy ones, from the 1-minute load average and the current use)")


def _threads_option(fn):
    return click.option("--threads", type=int, default=None, help=THREADS_HELP)(fn)


def _apply_threads(threads) -> int:
    from .utils.threads import apply_threads

    return apply_threads(threads)


class NameChoice(click.Choice):
    """click's Choice whose error names the closest valid value in one line, as every other unknown name does
    (:func:`flatfl.errors.unknown_name`): ``unknown partition 'iidd'. Did you mean 'iid'?``."""

    def __init__(self, choices, kind: str | None = None, **kwargs):
        super().__init__(list(choices), **kwargs)
        self.kind = kind

    def convert(self, value, param, ctx):
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            kind = self.kind or (param.name.replace("_", " ") if param is not None and param.name else "value")
            self.fail(str(unknown_name(kind, value, self.choices)), param, ctx)


# --------------------------------------------------------------------------------------------------------- train
def hparam_click_options() -> list[click.Option]:
    """One click option per hyper-parameter flag declared by any algorithm, optimizer or regularizer, by name."""
    from .train.catalog import all_hparams

    options = []
    for key, hp in sorted(all_hparams().items()):
        t = hp.py_type
        ctype = NameChoice(hp.choices, kind=key.replace("_", " ")) if hp.choices else {bool: click.BOOL, int: int, float: float}.get(t, str)
        options.append(click.Option([hp.cli_flag, key], type=ctype, default=None, show_default=False,
                                    help=_hparam_help(key)))
    return options


class TrainCommand(click.Command):
    """``flatfl train``: the hyper-parameter options are added when the command is parsed or its help shown, so
    that the other commands (``flatfl hessian``...) never import the training registries."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if not getattr(self, "hparams_added", False):
            self.hparams_added = True
            self.params.extend(hparam_click_options())
        return super().get_params(ctx)


def _hparam_help(key: str) -> str:
    """The flag's help: what it is, which pieces read it and the default each applies (a flag shared by several
    pieces gets the first one's description without its trailing note, then every piece's own default)."""
    import re

    from .train.catalog import KIND_FLAGS, hparam_declarations
    from .train.components import ALGORITHMS

    decl = hparam_declarations()[key]
    if len(decl) == 1:
        kind, name, hp = decl[0]
        return f"{hp.help} [{KIND_FLAGS[kind]} {name} only; default {hp.default!r}]"
    text = re.sub(r"\s*\([^()]*\)$", "", decl[0][2].help)
    parts = []
    for kind, name, hp in decl:
        also = [a for a, cls in sorted(ALGORITHMS.items()) if kind == "local optimizer" and cls.local_opt == name
                and key not in {h.key for h in cls.hparams}]
        parts.append(f"{KIND_FLAGS[kind]} {name}" + (f" (and --algo {', '.join(also)})" if also else "")
                     + f": {hp.default!r}")
    return f"{text} [default by piece: {'; '.join(parts)}]"


TRAIN_EPILOG = """\b
Examples:
  flatfl train                                     # FedAvg on the embedded digits, 20 clients, Dirichlet 0.3
  flatfl train --algo feddyn --reg man --zeta 0.15 --rounds 100 --out runs/dyn-man
  flatfl train --dataset cifar100 --data-dir ~/data --clients 100 --participation 0.1 \\
               --rounds 500 --local-epochs 5 --device cuda --config paper.toml
  flatfl train --resume runs/dyn-man               # continue a killed run
"""


@main.command(cls=TrainCommand, epilog=TRAIN_EPILOG)
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML or YAML file of settings; command-line values win.")
@click.option("--dataset", help="digits (embedded, default) | cifar10 | cifar100 | tinyimagenet | emnist | fashion-mnist")
@click.option("--data-dir", help="folder holding the dataset files (default ./data; Fashion-MNIST: then Debian's "
              "/usr/share/datasets/fashion-mnist)")
@click.option("--download/--no-download", default=None, help="fetch missing dataset files (default: yes, except "
              "Fashion-MNIST, whose usual source is 'apt-get install dataset-fashion-mnist')")
@click.option("--model", help="model name (default: the dataset's; see 'flatfl models')")
@click.option("--augment/--no-augment", default=None, help="flip + padded-crop augmentation (default: on for CIFAR/Tiny-ImageNet)")
@click.option("--partition", type=NameChoice(["dirichlet", "fedml-dirichlet", "iid"], kind="partition"), help="client split (default dirichlet)")
@click.option("--alpha", type=float, help="Dirichlet concentration (default 0.3)")
@click.option("--clients", type=int, help="number of clients N (default 20)")
@click.option("--participation", type=float, help="fraction / probability of clients per round, in (0, 1] (default 0.5)")
@click.option("--sampling", type=NameChoice(["bernoulli", "fraction"], kind="sampling"), help="bernoulli: each client joins with prob p (FedDyn code, default); fraction: a fixed round(pN)")
@click.option("--rounds", type=int, help="communication rounds (default 50)")
@click.option("--local-epochs", type=int, help="local epochs E (default 2)")
@click.option("--batch-size", type=int, help="local batch size B (default 50)")
@click.option("--lr", type=float, help="local learning rate eta0 (default 0.1)")
@click.option("--lr-decay", type=float, help="per-round learning-rate factor (default 0.998)")
@click.option("--weight-decay", type=float, help="SGD weight decay (default 1e-3)")
@click.option("--momentum", type=float, help="local SGD momentum (default 0)")
@click.option("--nesterov/--no-nesterov", default=None, help="Nesterov momentum (default off)")
@click.option("--clip", type=float, help="global gradient-norm clip, 0 = off (default 10)")
@click.option("--algo", help="FL algorithm (default fedavg; see 'flatfl algos')")
@click.option("--local-opt", help="local optimizer: sgd | sam | asam ... (default sgd)")
@click.option("--reg", help="local regularizer: none | man | asd | fedalign | ... (default none)")
@click.option("--seed", type=int, help="seed of every random choice (default 0)")
@click.option("--device", help="cpu | cuda | cuda:N | mps (default cpu)")
@click.option("--parallel-clients", help="train up to N of a round's participants at once as one batched computation, "
              "N an integer or 'all' (default: all on CUDA, 1 on CPU; the same numbers up to float rounding)")
@click.option("--float32-matmul", type=NameChoice(["full", "tf32"], kind="float32 mode"), help="float32 matrix "
              "products and convolutions on CUDA: full (IEEE float32, the default) or tf32 (TensorFloat-32: faster, "
              "about 1e-3 relative per product); recorded in config.json")
@click.option("--cuda-graphs/--no-cuda-graphs", default=None, help="CUDA: capture a cohort's local step once a round "
              "as a CUDA graph and replay it (one launch a step); steps that cannot be replayed exactly run eagerly, "
              "with a one-line notice (default off)")
@click.option("--eval-every", type=int, help="evaluate every k rounds (default 1)")
@click.option("--checkpoint-every", type=int, help="write a checkpoint every k rounds (default 10)")
@click.option("--save-clients/--no-save-clients", default=None, help="also write each client's latest local model (clients.pt)")
@click.option("--out", type=click.Path(file_okay=False), help="run directory (default runs/<dataset>-<algo>-<reg>-<partition>-s<seed>)")
@click.option("--track-hessian", type=int, help="every K rounds and at the end, the server model's top Hessian "
              "eigenvalue, trace (with standard error) and loss on a fixed evaluation set, as columns of metrics.csv "
              "(the numbers 'flatfl hessian' gives with the same settings; 0 = off, the default)")
@click.option("--track-top", type=int, help="with --track-hessian: how many top eigenvalues (default "
              f"{TRACKING.top}; 0 = trace only)")
@click.option("--track-samples", type=int, help="with --track-hessian: size of the fixed evaluation sample of the "
              f"training split (default {TRACKING.samples})")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False), help="continue the run in this directory")
@click.option("--force", is_flag=True, help="overwrite an existing run directory")
@click.option("--quiet", is_flag=True, help="no progress output")
@_threads_option
@friendly_errors
def train(config_file, resume_dir, force, quiet, **opts):
    """Simulate federated training and write a run directory (config, partition, metrics.csv, checkpoints)."""
    from .analysis.tracking import curvature_observer
    from .train.run import train_from_options

    tracking = {k: v for k, v in (("top", opts.pop("track_top")), ("samples", opts.pop("track_samples")))
                if v is not None}
    if tracking:
        opts["track_hessian_settings"] = tracking
    final = train_from_options(config_file=config_file, resume_dir=resume_dir, force=force, quiet=quiet, opts=opts,
                               observer_for=curvature_observer)
    click.echo(_train_summary(final))


def _train_summary(final) -> str:
    """One line: the last evaluated round's test accuracy (server model, all-clients average) and the checkpoint."""
    import csv

    rows = []
    metrics = Path(final).parent / "metrics.csv"
    if metrics.is_file():
        with open(metrics, newline="") as f:
            rows = list(csv.DictReader(f))
    if not rows:
        return f"trained -> {final}"
    last = rows[-1]
    return (f"round {last['round']}: test accuracy {100 * float(last['test_acc']):.2f}% (server model), "
            f"{100 * float(last['all_test_acc']):.2f}% (average of all clients' models) -> {final}")


@main.command()
@click.option("--dataset", default="digits", show_default=True)
@click.option("--data-dir", default="data", show_default=True)
@click.option("--partition", "method", type=NameChoice(["dirichlet", "fedml-dirichlet", "iid"], kind="partition"), default="dirichlet", show_default=True)
@click.option("--alpha", type=float, default=0.3, show_default=True)
@click.option("--clients", type=int, default=20, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--run", "run_dir", type=click.Path(file_okay=False), help="print the partition saved in this run instead")
@friendly_errors
def partition(dataset, data_dir, method, alpha, clients, seed, run_dir):
    """Print the per-client label histogram of a partition (or of a run's saved partition)."""
    from .train.run import describe_partition

    click.echo(describe_partition(dataset, data_dir, method, alpha, clients, seed, run_dir))


@main.command()
@friendly_errors
def algos():
    """List algorithms, local optimizers and regularizers with their hyper-parameters and defaults."""
    from .train.catalog import describe, load_all
    from .train.components import ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS

    load_all()
    for title, reg in (("Algorithms (--algo)", ALGORITHMS), ("Local optimizers (--local-opt)", LOCAL_OPTIMIZERS),
                       ("Regularizers (--reg)", REGULARIZERS)):
        click.echo(f"{title}\n" + describe(reg) + "\n")


@main.command()
@friendly_errors
def models():
    """List the model names."""
    from .models import model_names

    click.echo("\n".join(model_names()))


# --------------------------------------------------------------------------------------------------------- hessian
HESSIAN_DEFAULTS = HessianSettings()
HESSIAN_EPILOG = """\b
Examples:
  flatfl hessian runs/x/final.pt --out runs/x/hessian             # top eigenvalue + Hutch++ trace, whole train split
  flatfl hessian runs/x --top 200 --density --samples 4096 --out runs/x/hessian
  flatfl hessian runs/x --method power --samples 4096 --out h-pyh  # PyHessian's protocol (power + its trace rule)
"""


@main.command(epilog=HESSIAN_EPILOG)
@click.argument("checkpoint", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="output directory (hessian.json, eigenvalues.csv, figures)")
@click.option("--top", type=int, default=HESSIAN_DEFAULTS.top, show_default=True, help="number of top eigenvalues (0 = none): the largest algebraic "
              "with --method lanczos, the largest in magnitude with --method power (they differ at saddles, where "
              "negative eigenvalues are large)")
@click.option("--trace/--no-trace", default=HESSIAN_DEFAULTS.trace, show_default=True, help="estimate the trace")
@click.option("--density/--no-density", default=HESSIAN_DEFAULTS.density, show_default=True, help="eigenvalue spectral density (SLQ)")
@click.option("--samples", type=int, default=HESSIAN_DEFAULTS.samples, help="draw N evaluation samples once with --seed (default: whole split)")
@click.option("--batch-size", type=int, default=HESSIAN_DEFAULTS.batch_size, show_default=True, help="evaluation batch size (does not change the result)")
@click.option("--split", default=HESSIAN_DEFAULTS.split, show_default=True, help="train | test")
@click.option("--method", default=HESSIAN_DEFAULTS.method, show_default=True, help=f"{' | '.join(METHODS)} (power: PyHessian's rule)")
@click.option("--tol", type=float, default=HESSIAN_DEFAULTS.tol, show_default=True, help="eigenvalue tolerance (Lanczos: relative residual; power: relative change)")
@click.option("--trace-method", default=HESSIAN_DEFAULTS.trace_method, help=f"{' | '.join(TRACE_METHODS)} (default: hutchpp; pyhessian with --method power)")
@click.option("--trace-hvps", type=int, default=HESSIAN_DEFAULTS.trace_hvps, show_default=True, help="HVP budget of the trace estimate")
@click.option("--trace-rtol", type=float, default=HESSIAN_DEFAULTS.trace_rtol, show_default=True, help="stop the trace at this relative standard error")
@click.option("--density-steps", type=int, default=HESSIAN_DEFAULTS.density_steps, show_default=True, help="Lanczos steps per SLQ start")
@click.option("--density-starts", type=int, default=HESSIAN_DEFAULTS.density_starts, show_default=True, help="number of SLQ starts")
@click.option("--seed", type=int, default=HESSIAN_DEFAULTS.seed, show_default=True, help="seed of the sample draw and of every random vector")
@click.option("--device", default=HESSIAN_DEFAULTS.device, show_default=True, help="cpu | cuda | cuda:N | mps")
@click.option("--data-dir", default=HESSIAN_DEFAULTS.data_dir, help="dataset folder (default: the one recorded in the checkpoint)")
@click.option("--save-eigenvectors", is_flag=True, default=HESSIAN_DEFAULTS.save_eigenvectors, help="also write eigenvectors.pt (parameter layout included)")
@click.option("--model-factory", default=HESSIAN_DEFAULTS.model_factory, help="module:function or path/to/file.py:function building your own network (default: the one the run recorded); only its weights are loaded")
@click.option("--exact-residuals", is_flag=True, default=HESSIAN_DEFAULTS.exact_residuals,
              help="recompute each residual ||Hv - lambda v|| with one more HVP (without it, Lanczos reports the "
              "residual of its recurrence: an estimate that can understate the true one by orders of magnitude)")
@click.option("--quiet", is_flag=True, help="no progress bar")
@_threads_option
@friendly_errors
def hessian(checkpoint, out, threads, **opts):
    """Top Hessian eigenvalues, trace and spectral density of a checkpoint's model (mean loss, eval mode)."""
    from .analysis.hessian_run import run_hessian

    _apply_threads(threads)
    report = run_hessian(checkpoint, out, **opts)
    values = report["top_eigenvalues"]
    found = []
    if values:
        shown = ", ".join(f"{v:.6g}" for v in values[:5]) + (" ..." if len(values) > 5 else "")
        eigen = report.get("eigen") or {}
        kind = "largest magnitude" if eigen.get("method") == "power" else "largest algebraic"
        click.echo(f"top eigenvalues ({kind}): {shown}")
        found.append(f"top eigenvalue {values[0]:.6g}{_multiplicity_note(eigen.get('multiplicity'))}")
    if report["trace"]:
        tr = report["trace"]
        stderr = "n/a" if tr["stderr"] is None else f"{tr['stderr']:.3g}"
        click.echo(f"trace: {tr['estimate']:.6g} +- {stderr} ({tr['method']}, {tr['hvps']} HVPs)")
        found.append(f"trace {tr['estimate']:.6g} +- {stderr}")
    if report.get("density"):
        found.append("spectral density")
    click.echo(f"{', '.join(found)} on {report.get('num_samples')} samples; {report['hvps_total']} HVPs in "
               f"{report['seconds']:.1f} s -> {Path(out) / 'hessian.json'}")


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


@main.command("hessian-clients", epilog=HESSIAN_CLIENTS_EPILOG)
@click.argument("checkpoint", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="output directory (clients-<protocol>.json and its heat map; each protocol its own files)")
@click.option("--protocol", default=CLIENTS_DEFAULTS.protocol, show_default=True, help=f"{' | '.join(PROTOCOLS)} (fedalign: FedAlign's code, to reproduce its Table 1)")
@click.option("--probes", type=int, default=CLIENTS_DEFAULTS.probes, show_default=True, help="Rademacher probes per client (fedalign: the most, PyHessian's maxIter)")
@click.option("--groups", type=int, default=CLIENTS_DEFAULTS.groups, show_default=True, help="jackknife groups of probes for the standard errors")
@click.option("--samples", type=int, default=CLIENTS_DEFAULTS.samples, help="samples per client (default: all) | fedalign: global samples (default 640)")
@click.option("--batch-size", type=int, default=CLIENTS_DEFAULTS.batch_size, help="evaluation batch size (default 256; fedalign 64)")
@click.option("--tol", type=float, default=CLIENTS_DEFAULTS.tol, show_default=True, help="fedalign: PyHessian's relative stopping tolerance")
@click.option("--seed", type=int, default=CLIENTS_DEFAULTS.seed, show_default=True, help="seed of the sample draws and the probes")
@click.option("--device", default=CLIENTS_DEFAULTS.device, show_default=True, help="cpu | cuda | cuda:N | mps")
@click.option("--data-dir", default=CLIENTS_DEFAULTS.data_dir, help="dataset folder (default: the one recorded in the checkpoint)")
@click.option("--model-factory", default=CLIENTS_DEFAULTS.model_factory, help="module:function or path/to/file.py:function building your own network (default: the one the run recorded); only its weights are loaded")
@click.option("--quiet", is_flag=True, help="no progress bar")
@_threads_option
@friendly_errors
def hessian_clients(checkpoint, out, threads, **opts):
    """Cross-client Hessian metrics H_N and H_D (FedAlign Eq. 3-4) with standard errors."""
    from .analysis.clients_run import run_client_metrics

    _apply_threads(threads)
    c = run_client_metrics(checkpoint, out, **opts)

    def show(value, err):
        return "n/a" if value is None else f"{value:.6g} +- {'n/a' if err is None else f'{err:.3g}'}"

    click.echo(f"protocol {c['protocol']} ({c['num_clients']} clients, {c['pairs']} pairs, {c['estimator']})")
    click.echo(f"H_N: {show(c['H_N'], c['H_N_stderr'])}")
    click.echo(f"H_D: {show(c['H_D'], c['H_D_stderr'])}")
    click.echo(f"H_N {show(c['H_N'], c['H_N_stderr'])}, H_D {show(c['H_D'], c['H_D_stderr'])} "
               f"({c['protocol']} protocol, {c['num_clients']} clients); {c['hvps']} HVPs in {c['seconds']:.1f} s "
               f"-> {Path(out) / c['files'][-1]}")


# --------------------------------------------------------------------------------------------------------- surface
SURFACE_DEFAULTS = SurfaceSettings()
SURFACE_EPILOG = """\b
Examples:
  flatfl surface runs/x --out runs/x/surface                          # random filter-normalised, 21 x 21, range 1
  flatfl surface runs/x --directions hessian --grid 41 --samples 2048 --workers 2 --out runs/x/surface-h
  flatfl surface runs/x --directions hessian --eigenvectors runs/x/hessian/eigenvectors.pt --out s
Killed? Run the same command again: finished grid points are kept in surface.npz and not recomputed.
"""


@main.command(epilog=SURFACE_EPILOG)
@click.argument("checkpoint", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="output directory (surface.npz/.csv/.json, figures)")
@click.option("--directions", default=SURFACE_DEFAULTS.directions, show_default=True, help=f"{' | '.join(DIRECTION_KINDS)} (random: filter-normalised; hessian: top-2 eigenvectors)")
@click.option("--grid", type=int, default=SURFACE_DEFAULTS.grid, show_default=True, help="points per axis (linspace(-R, R, N))")
@click.option("--range", "range_", type=float, default=SURFACE_DEFAULTS.range, show_default=True, help="half-width R of the square")
@click.option("--samples", type=int, default=SURFACE_DEFAULTS.samples, help="draw N evaluation samples once with --seed (default: whole split)")
@click.option("--workers", type=int, default=SURFACE_DEFAULTS.workers, show_default=True, help="local worker processes (CPU)")
@click.option("--batch-size", type=int, default=SURFACE_DEFAULTS.batch_size, show_default=True, help="evaluation batch size")
@click.option("--split", default=SURFACE_DEFAULTS.split, show_default=True, help="train | test")
@click.option("--seed", type=int, default=SURFACE_DEFAULTS.seed, show_default=True, help="seed of the sample draw and the random directions")
@click.option("--include-bn-bias", is_flag=True, default=SURFACE_DEFAULTS.include_bn_bias, help="random directions also move 1-D tensors (biases, norm affine)")
@click.option("--eigenvectors", type=click.Path(), default=SURFACE_DEFAULTS.eigenvectors, help="eigenvectors.pt from 'flatfl hessian --save-eigenvectors'")
@click.option("--tol", type=float, default=SURFACE_DEFAULTS.tol, show_default=True, help="Lanczos tolerance for --directions hessian")
@click.option("--device", default=SURFACE_DEFAULTS.device, show_default=True, help="cpu | cuda | cuda:N | mps")
@click.option("--data-dir", default=SURFACE_DEFAULTS.data_dir, help="dataset folder (default: the one recorded in the checkpoint)")
@click.option("--force", is_flag=True, default=SURFACE_DEFAULTS.force, help="start over instead of resuming surface.npz in --out")
@click.option("--model-factory", default=SURFACE_DEFAULTS.model_factory, help="module:function or path/to/file.py:function building your own network (default: the one the run recorded); only its weights are loaded")
@click.option("--quiet", is_flag=True, help="no progress bar")
@_threads_option
@friendly_errors
def surface(checkpoint, out, range_, threads, **opts):
    """Loss and accuracy on a 2-D grid around a checkpoint's model (contour and 3-D figures)."""
    from .analysis.surface_run import run_surface

    _apply_threads(threads)
    report = run_surface(checkpoint, out, range=range_, **opts)
    origin = report["loss_at_origin"]
    shown = "" if origin is None else f", loss at origin {origin:.6g}"
    click.echo(f"loss min {report['loss_min']:.6g}, max {report['loss_max']:.6g}{shown}; {report['points']} points "
               f"({report['points_computed_now']} computed now) in {report['seconds']:.1f} s "
               f"-> {Path(out) / 'surface.json'}")


# --------------------------------------------------------------------------------------------------------- report
REPORT_EPILOG = """\b
Examples:
  flatfl report runs/sweep --out reports/sweep                 # every run under runs/sweep
  flatfl report runs/a runs/b --out reports/ab --compute-missing --top 50 --density
  flatfl report runs/reproduce-quick --table man-table2 --out reports/t2
"""


@main.command(epilog=REPORT_EPILOG)
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path())
@click.option("--out", required=True, type=click.Path(file_okay=False), help="report folder (CSV, report.md, report.pdf)")
@click.option("--table", "tables", multiple=True,
              help=f"paper layout: {' | '.join(TARGETS)} (repeatable; default: every layout the runs fill)")
@click.option("--compute-missing", is_flag=True, help="compute missing Hessian (and H_N / H_D) results instead of listing them")
@click.option("--model", type=NameChoice(["server", "clients-average"], kind="model"), default=None,
              help="the model every row measures (accuracy and Hessian); default: clients-average for the MAN tables (MAN reports the all-clients average), server for FedAlign's")
@click.option("--top", type=int, default=None, help="Hessian asked for: number of top eigenvalues (--compute-missing default 1)")
@click.option("--density/--no-density", default=None, help="Hessian asked for: with the spectral density (--compute-missing default: no)")
@click.option("--samples", type=int, default=None, help="Hessian asked for: evaluation samples (default: the whole training split)")
@click.option("--method", default=None, help="Hessian asked for: lanczos | power (--compute-missing default lanczos)")
@click.option("--device", default="cpu", show_default=True, help="--compute-missing: cpu | cuda | cuda:N | mps")
@_threads_option
@friendly_errors
def report(run_dirs, out, tables, model, compute_missing, top, density, samples, method, device, threads):
    """Tables (CSV, Markdown) and one PDF from run directories, with the papers' values beside ours.

    A Hessian option given (--top, --density, --samples, --method) asks for those settings: only analyses made
    with them fill the table, and --compute-missing computes them (into a folder of their own where an analysis
    with other settings exists)."""
    from .report import build_report

    _apply_threads(threads)
    hessian = {k: v for k, v in {"top": top, "density": density, "samples": samples, "method": method}.items()
               if v is not None}
    summary = build_report(list(run_dirs), out, tables=list(tables) or None, compute_missing=compute_missing,
                           hessian=hessian, device=device, echo=click.echo, model=model)
    _echo_summary(summary, out)


def _echo_summary(summary: dict, out) -> None:
    from .report.pdf import counts_line

    for key, counts in summary["directions"].items():
        for metric, c in counts.items():
            click.echo(f"{key}: {counts_line(metric, c)}")
    for line in summary.get("notices", []):
        if not line.startswith("computed for"):  # those were echoed as they happened
            click.echo(f"notice: {line}", err=True)
    for line in summary["missing"]:
        click.echo(f"missing: {line}", err=True)
    tables = ", ".join(summary.get("tables") or []) or "no paper table"
    click.echo(f"{summary['runs']} runs, tables: {tables}; {len(summary['pages'])} PDF pages -> {out}/report.pdf")


# ------------------------------------------------------------------------------------------------------- contrast
CONTRAST_EPILOG = """\b
Examples:
  flatfl contrast reports/man-tables-fmnist reports/man-tables-fmnist-cnn --label MLP --label CNN \\
      --out reports/man-tables-fmnist-contrast
"""


@main.command(epilog=CONTRAST_EPILOG)
@click.argument("reports", nargs=-1, required=True, type=click.Path())
@click.option("--out", required=True, type=click.Path(file_okay=False), help="folder for contrast.csv, contrast.md and contrast.json")
@click.option("--label", "labels", multiple=True, help="a name per report, in order (default: the folder names)")
@friendly_errors
def contrast(reports, out, labels):
    """Two or more reports of one table side by side: each comparison's change, interval and verdict per report."""
    from .report.contrast import write_contrast

    summary = write_contrast(list(reports), out, list(labels) or None)
    for line in summary["together"]:
        click.echo(line)
    click.echo(f"{summary['comparisons']} comparisons in {len(summary['reports'])} reports -> {Path(out) / 'contrast.md'}")


# ------------------------------------------------------------------------------------------------------ reproduce
REPRODUCE_EPILOG = """\b
Examples:
  flatfl reproduce man-tables --preset quick                  # MAN Tables 2 and 6 on digits (minutes, 2 cores)
  flatfl reproduce man-table2 --preset paper --data-dir ~/data --device cuda --executor ray
  flatfl reproduce fedalign-table1 --preset quick --out reports/fedalign
  flatfl reproduce man-table2 --preset quick --methods FedAvg,FedAvg+MAN --seeds 0,1   # two rows only
Re-running the same command skips finished runs and analyses and resumes interrupted runs.
"""


def _default_seeds_text() -> str:
    """'0,1,2 for quick, fmnist and fmnist-cnn, 0 for paper and tiny': each preset's default seeds."""
    by_seeds: dict[tuple, list[str]] = {}
    for preset in PRESETS:
        by_seeds.setdefault(DEFAULT_SEEDS[preset], []).append(preset)
    return ", ".join(f"{','.join(map(str, seeds))} for "
                     + (names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}")
                     for seeds, names in by_seeds.items())


def _executor_options(fn, threads_help="torch threads per run, an integer >= 1 (default: 1 on <= 2 cores, else the idle cores / workers)"):
    fn = click.option("--gpus-per-task", type=float, default=0, show_default=True, help="Ray: GPUs per run (e.g. 1 or 0.5)")(fn)
    fn = click.option("--ray-address", default=None, help="Ray: attach to this cluster (default $RAY_ADDRESS, else a local Ray)")(fn)
    fn = click.option("--threads", type=int, default=None, help=threads_help)(fn)
    fn = click.option("--workers", type=int, default=None, help="runs at once (local: processes; ray: CPUs of a local Ray); default: the number of CPU cores")(fn)
    fn = click.option("--executor", type=NameChoice(["local", "ray"], kind="executor"), default="local", show_default=True, help="where runs execute")(fn)
    return fn


@main.command(epilog=REPRODUCE_EPILOG, help="Train, analyse and report one paper table: MAN Table 2 / Table 6, FedAlign "
              "Table 1.\n\n\b\nTARGET: " + ", ".join(TARGETS))  # a name per target, none broken at its hyphens
@click.argument("target", type=NameChoice(TARGETS, kind="reproduction target"), metavar="TARGET")
@click.option("--preset", type=NameChoice(PRESETS, kind="preset"), default="quick", show_default=True,
              help="quick: digits on a CPU; fmnist: Fashion-MNIST, MLP, on a CPU (<= 1 h on 2 cores); fmnist-cnn: Fashion-MNIST, the paper's CNN at LeNet-5 widths, on a CPU (<= 1 h on 2 cores); paper: the papers' settings (dataset + GPU); tiny: seconds, for tests")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="report folder (default reports/<target>-<preset>)")
@click.option("--runs-dir", type=click.Path(file_okay=False), default=None, help="run folder (default runs/reproduce-<preset>)")
@click.option("--seeds", default=None, help=f"comma-separated seeds, e.g. 0,1,2 (default: {_default_seeds_text()})")
@click.option("--device", default="cpu", show_default=True, help="cpu | cuda | cuda:N | mps")
@click.option("--data-dir", default=None, help="dataset folder (paper preset: CIFAR-100)")
@click.option("--model", type=NameChoice(["server", "clients-average"], kind="model"), default=None,
              help="the model the Hessian and the table measure; default: clients-average for the MAN tables, server for FedAlign's")
@click.option("--track-hessian", type=int, default=None, help="curvature during training every K rounds (flatfl train "
              "--track-hessian; drawn against rounds in the report); 0 = off; default: the preset's (quick: 10)")
@click.option("--methods", default=None, help="comma-separated rows of the table to run, e.g. FedAvg,FedAvg+MAN "
              "(default: every row)")
@functools.partial(_executor_options, threads_help="torch threads per run, an integer >= 1 (default: 1 whatever the "
                   "machine, since the thread count changes the numbers; recorded in each run's config.json)")
@friendly_errors
def reproduce(target, preset, out, runs_dir, seeds, device, data_dir, model, track_hessian, methods, executor, workers,
              threads, ray_address, gpus_per_task):
    """Train, analyse and report one paper table: MAN Table 2 / Table 6, FedAlign Table 1."""
    from .errors import ConfigError
    from .executors import make_executor
    from .reproduce import reproduce as run_reproduction

    try:
        seed_list = None if seeds is None else tuple(int(s) for s in seeds.split(",") if s.strip())
    except ValueError:
        raise ConfigError(f"--seeds must be comma-separated integers, got {seeds!r}") from None
    from .utils.threads import check_threads

    check_threads(threads)
    ex = make_executor(executor, workers=workers, address=ray_address, gpus_per_task=gpus_per_task)
    summary = run_reproduction(target, preset, out=out, runs_dir=runs_dir, executor=ex, seeds=seed_list,
                               device=device, data_dir=data_dir, threads=threads, echo=click.echo, model=model,
                               track_hessian=track_hessian, methods=methods, progress_bar=sys.stderr.isatty())
    report_dir = out or f"reports/{target}-{preset}"
    _echo_summary(summary, report_dir)
    tasks = summary.get("tasks") or []
    n_failed = len(summary["failed"])
    click.echo(f"{target} ({preset}): {len(tasks) - n_failed} of {len(tasks)} runs done, "
               f"{len(summary.get('tables') or [])} tables in {summary['seconds']:.0f} s -> {report_dir}/report.pdf")
    if summary["failed"]:
        click.echo("flatfl: error: " + error_line(f"{len(summary['failed'])} run(s) failed: "
                                                  + "; ".join(summary["failed"][:3])), err=True)
        sys.exit(1)


# ---------------------------------------------------------------------------------------------------------- sweep
SWEEP_EPILOG = """\b
Examples:
  flatfl sweep grid.toml                                   # on this machine, one run per CPU core
  flatfl sweep grid.toml --workers 1                       # one run at a time
  flatfl sweep grid.toml --executor ray --ray-address auto --gpus-per-task 1
  flatfl sweep grid.toml --dry-run                         # list the runs and their state
\b
grid.toml:
  out = "runs/man-grid"
  seeds = [0, 1]
  [fixed]
  dataset = "digits"
  rounds = 30
  [grid]
  algo = ["fedavg", "feddyn"]
  reg = ["none", "man"]
  alpha = [0.3, 0.6]
  [hessian]            # optional: flatfl hessian options, per final model
  top = 1
  # track_hessian = 5  (in [fixed]: curvature every 5 rounds, flatfl train --track-hessian)
"""


@main.command(epilog=SWEEP_EPILOG)
@click.argument("grid_file", type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(file_okay=False), default=None, help="root of the run folders (default: the file's 'out', else runs/<file name>)")
@click.option("--dry-run", is_flag=True, help="list the runs and whether each is new, partial or finished")
@_executor_options
@friendly_errors
def sweep(grid_file, out, dry_run, executor, workers, threads, ray_address, gpus_per_task):
    """Run a grid of trainings (and analyses) from a TOML/YAML file; resumable, finished runs skipped."""
    from .executors import make_executor
    from .sweep import run_sweep

    ex = None if dry_run else make_executor(executor, workers=workers, address=ray_address, gpus_per_task=gpus_per_task)
    records = run_sweep(grid_file, executor=ex, out=out, threads=threads, dry_run=dry_run, echo=click.echo)
    if dry_run:
        return
    failed = [r for r in records if r.get("error")]
    root = Path(records[0]["run_dir"]).parent if records else out
    click.echo(f"{len(records) - len(failed)} of {len(records)} runs done -> {root}/sweep.csv")
    if failed:
        click.echo("flatfl: error: " + error_line(f"{len(failed)} run(s) failed: "
                                                  + "; ".join(f"{r['name']}: {r['error']}" for r in failed[:3])), err=True)
        sys.exit(1)
