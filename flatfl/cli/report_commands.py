"""``flatfl report``, ``contrast``, ``reproduce`` and ``sweep``: many runs at once, and the tables made of them."""
from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import click

from ..analysis.commands.hessian_settings import HessianSettings  # no torch: the defaults and the estimators' names
from ..analysis.estimators.quantities import measure_record, quantity_names
from ..analysis.estimators.registry import estimator_names
from ..errors import error_line
from ..paper_tables import DEFAULT_SEEDS, PRESETS, TARGETS  # no torch: the tables flatfl reproduce makes
from ..utils.precision import PRECISIONS
from .common import LazyHelp, NameChoice, apply_threads, friendly_errors, threads_option

__all__ = ["report", "contrast", "reproduce", "sweep", "echo_summary"]


REPORT_EPILOG = """\b
Examples:
  flatfl report runs/sweep --out reports/sweep                 # every run under runs/sweep
  flatfl report runs/a runs/b --out reports/ab --compute-missing --top 50 --density
  flatfl report runs/reproduce-quick --table man-table2 --out reports/t2
  flatfl report reports/old/runs.csv --out reports/old-now   # re-render a report from its runs.csv alone
"""


@click.command(epilog=REPORT_EPILOG)
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path())
@click.option("--out", required=True, type=click.Path(file_okay=False), help="report folder (CSV, report.md, effects.png, report.pdf)")
@click.option("--table", "tables", multiple=True,
              help=f"paper layout: {' | '.join(TARGETS)} (repeatable; default: every layout the runs fill)")
@click.option("--compute-missing", is_flag=True, help="compute missing Hessian (and H_N / H_D) results instead of listing them")
@click.option("--model", type=NameChoice(["server", "clients-average"], kind="model"), default=None,
              help="the model every row measures (accuracy and Hessian); default: clients-average for the MAN tables (MAN reports the all-clients average), server for FedAlign's")
@click.option("--top", type=int, default=None, help="Hessian asked for: number of top eigenvalues (--compute-missing default 1)")
@click.option("--smallest", type=int, default=None, help="Hessian asked for: also the K smallest (most negative) eigenvalues, shown as the tables' smallest-eigenvalue column (--compute-missing default 0)")
@click.option("--measure", default=None, metavar="NAME[,NAME...]", cls=LazyHelp,
              lazy_help=lambda: "Hessian asked for: also these measured quantities, each shown as a column of the "
              f"tables ({' | '.join(quantity_names())}; --compute-missing default: none)")
@click.option("--density/--no-density", default=None, help="Hessian asked for: with the spectral density (--compute-missing default: no)")
@click.option("--samples", type=int, default=None, help="Hessian asked for: evaluation samples (default: the whole training split)")
@click.option("--method", default=None, cls=LazyHelp,
              lazy_help=lambda: f"Hessian asked for: {' | '.join(estimator_names('eigenvalues'))} (--compute-missing "
              f"default {HessianSettings.method})")
@click.option("--device", default="cpu", show_default=True, help="--compute-missing: cpu | cuda | cuda:N | mps")
@threads_option
@friendly_errors
def report(run_dirs, out, tables, model, threads, compute_missing, device, **hessian):
    """Tables (CSV, Markdown) and one PDF from run directories, with the papers' values beside ours.

    RUN_DIRS: run folders (or folders holding runs), or else one runs.csv (a file named *.csv: an earlier report's,
    or one shared without its runs) to re-render: the same numbers in the current tables, verdicts and forest plot;
    what only a run folder holds (curves, spectra, surfaces, provenance checks, training settings) is left out and
    said. A runs.csv is re-rendered alone (no run folders beside it, no --compute-missing or Hessian options).

    A Hessian option given (--top, --smallest, --measure, --density, --samples, --method) asks for those settings: only
    analyses made with them fill the table, and --compute-missing computes them (into a folder of their own where an
    analysis with other settings exists). Runs whose analyses hold the smallest eigenvalue (--smallest) give the
    tables a smallest-eigenvalue column, and those measuring a quantity (--measure) a column of it."""
    from ..report import build_report
    from ..report.pipeline import AnalysesAsked

    apply_threads(threads)
    asked = {k: hessian[k] for k in ("top", "smallest", "density", "samples", "method") if hessian[k] is not None}
    if hessian["measure"] is not None:  # as hessian.json records it: registered names in the registry's order
        asked["measure"] = measure_record(hessian["measure"])
    analyses = AnalysesAsked(asked, compute_missing, device)  # the Hessian settings asked for, computed if missing
    summary = build_report(list(run_dirs), out, tables=list(tables) or None, analyses=analyses, echo=click.echo,
                           model=model)
    echo_summary(summary, out)


def echo_summary(summary: dict, out) -> None:
    from ..report.pdf import counts_line

    for key, counts in summary["directions"].items():
        for metric, c in counts.items():
            click.echo(f"{key}: {counts_line(metric, c)}")
    for sentence in summary.get("headline") or []:  # what the tables found, as the report's first page says it
        click.echo(sentence)
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


@click.command(epilog=CONTRAST_EPILOG)
@click.argument("reports", nargs=-1, required=True, type=click.Path())
@click.option("--out", required=True, type=click.Path(file_okay=False), help="folder for contrast.csv, contrast.md and contrast.json")
@click.option("--label", "labels", multiple=True, help="a name per report, in order (default: the folder names)")
@friendly_errors
def contrast(reports, out, labels):
    """Two or more reports of one table side by side: each comparison's change, interval and verdict per report."""
    from ..report.contrast import write_contrast

    summary = write_contrast(list(reports), out, list(labels) or None)
    click.echo(summary["settings_line"])
    for line in summary["together"]:
        click.echo(line)
    if summary.get("dropped"):
        click.echo(f"notice: {len(summary['dropped'])} comparisons not held by every report are left out (listed in "
                   f"{Path(out) / 'contrast.md'})", err=True)
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


#: what Ctrl-C leaves of a sweep or a reproduction (its workers are stopped: flatfl.utils.processes.worker_pool)
RUNS_KEPT = "finished runs are kept, rerun the same command to resume"


@contextlib.contextmanager
def _runs_kept_on_interrupt():
    """Ctrl-C in a sweep or a reproduction: the one line says that finished runs stay and the same command resumes
    (:func:`flatfl.cli.common.interrupted_line`)."""
    try:
        yield
    except KeyboardInterrupt as e:
        e.hint = RUNS_KEPT
        raise


def _default_seeds_text() -> str:
    """'0,1,2 for quick, fmnist and fmnist-cnn, 0 for paper and tiny': each preset's default seeds."""
    by_seeds: dict[tuple, list[str]] = {}
    for preset in PRESETS:
        by_seeds.setdefault(DEFAULT_SEEDS[preset], []).append(preset)
    return ", ".join(f"{','.join(map(str, seeds))} for "
                     + (names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}")
                     for seeds, names in by_seeds.items())


@dataclass(frozen=True)
class Execution:
    """How the runs of a sweep or a reproduction execute, as the options of :func:`_executor_options` say: where
    (``executor``: 'local' processes or 'ray'), how many at once (``workers``; None: the CPU cores), torch
    ``threads`` per run (None: the command's default), and for Ray the cluster (``ray_address``) and the GPUs per
    run (``gpus_per_task``)."""
    executor: str = "local"
    workers: int | None = None
    threads: int | None = None
    ray_address: str | None = None
    gpus_per_task: float = 0

    @classmethod
    def taken_from(cls, options: dict) -> "Execution":
        """The execution options, taken out of a command's ``options``."""
        return cls(**{f.name: options.pop(f.name) for f in fields(cls)})

    def make_executor(self):
        """The executor (:func:`flatfl.executors.make_executor`, which checks the options)."""
        from ..executors import make_executor

        return make_executor(self.executor, workers=self.workers, address=self.ray_address,
                             gpus_per_task=self.gpus_per_task)


def _executor_options(fn, threads_help="torch threads per run, an integer >= 1 (default: 1 on <= 2 cores, else the idle cores / workers)"):
    fn = click.option("--gpus-per-task", type=float, default=0, show_default=True, help="Ray: GPUs per run (e.g. 1 or 0.5)")(fn)
    fn = click.option("--ray-address", default=None, help="Ray: attach to this cluster (default $RAY_ADDRESS, else a local Ray)")(fn)
    fn = click.option("--threads", type=int, default=None, help=threads_help)(fn)
    fn = click.option("--workers", type=int, default=None, help="runs at once (local: processes; ray: CPUs of a local Ray); default: the number of CPU cores")(fn)
    fn = click.option("--executor", type=NameChoice(["local", "ray"], kind="executor"), default="local", show_default=True, help="where runs execute")(fn)
    return fn


@click.command(epilog=REPRODUCE_EPILOG, help="Train, analyse and report one paper table: MAN Table 2 / Table 6, FedAlign "
              "Table 1, or the SAM family's curvature side by side.\n\n\b\nTARGET: " + ", ".join(TARGETS))  # a name per target, none broken at its hyphens
@click.argument("target", type=NameChoice(TARGETS, kind="reproduction target"), metavar="TARGET")
@click.option("--preset", type=NameChoice(PRESETS, kind="preset"), default="quick", show_default=True,
              help="quick: digits on a CPU; fmnist: Fashion-MNIST, MLP, on a CPU (<= 1 h on 2 cores); fmnist-cnn: Fashion-MNIST, the paper's CNN at LeNet-5 widths, on a CPU (over 1 h on 2 cores); paper: the papers' settings (dataset + GPU); tiny: seconds, for tests")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="report folder (default reports/<target>-<preset>; "
              "with --methods or other --seeds than the preset's, reports/<target>-<preset>-<selection>); a report "
              "there of runs this reproduction does not run is refused")
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
@click.option("--precision", type=NameChoice(PRECISIONS, kind="precision"), default=None, help="the runs' floating "
              "type: float32 | float64 (default: the preset's, float64 for quick, fmnist and fmnist-cnn, float32 "
              "for paper and tiny; float64 on a GPU is slow)")
@functools.partial(_executor_options, threads_help="torch threads per run, an integer >= 1 (default: 1 whatever the "
                   "machine, since the thread count changes the numbers; recorded in each run's config.json)")
@friendly_errors
def reproduce(target, preset, seeds, methods, model, out, runs_dir, **options):
    """Train, analyse and report one paper table: MAN Table 2 / Table 6, FedAlign Table 1, or the SAM family."""
    from ..errors import ConfigError
    from ..reproduce import RunOptions, Selection, reproduce as run_reproduction

    try:
        seed_list = None if seeds is None else tuple(int(s) for s in seeds.split(",") if s.strip())
    except ValueError:
        raise ConfigError(f"--seeds must be comma-separated integers, got {seeds!r}") from None
    from ..utils.threads import check_threads

    execution = Execution.taken_from(options)
    check_threads(execution.threads)
    ex = execution.make_executor()
    selection = Selection(target, preset, seed_list, methods, model)
    runs = RunOptions(threads=execution.threads, **options)  # --device, --data-dir, --track-hessian, --precision
    with _runs_kept_on_interrupt():
        summary = run_reproduction(selection, runs, out=out, runs_dir=runs_dir, executor=ex, echo=click.echo,
                                   progress_bar=sys.stderr.isatty())
    report_dir = summary.get("out") or out
    echo_summary(summary, report_dir)
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


@click.command(epilog=SWEEP_EPILOG)
@click.argument("grid_file", type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(file_okay=False), default=None, help="root of the run folders (default: the file's 'out', else runs/<file name>)")
@click.option("--dry-run", is_flag=True, help="list the runs and whether each is new, partial or finished")
@click.option("--precision", type=NameChoice(PRECISIONS, kind="precision"), default=None, help="every run's floating "
              "type: float32 | float64 (default: the file's 'precision', else float32)")
@_executor_options
@friendly_errors
def sweep(grid_file, out, dry_run, precision, **options):
    """Run a grid of trainings (and analyses) from a TOML/YAML file; resumable, finished runs skipped."""
    from ..sweep import run_sweep

    execution = Execution(**options)
    ex = None if dry_run else execution.make_executor()
    with _runs_kept_on_interrupt():
        records = run_sweep(grid_file, executor=ex, out=out, threads=execution.threads, dry_run=dry_run,
                            echo=click.echo, precision=precision)
    if dry_run:
        return
    failed = [r for r in records if r.get("error")]
    root = Path(records[0]["run_dir"]).parent if records else out
    click.echo(f"{len(records) - len(failed)} of {len(records)} runs done -> {root}/sweep.csv")
    if failed:
        click.echo("flatfl: error: " + error_line(f"{len(failed)} run(s) failed: "
                                                  + "; ".join(f"{r['name']}: {r['error']}" for r in failed[:3])), err=True)
        sys.exit(1)
