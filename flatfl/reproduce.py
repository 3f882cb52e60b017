"""``flatfl reproduce``: every training, analysis and the report behind one paper table, in one command.

Targets (one module each in :mod:`flatfl.paper_tables`: the layout, the methods, the presets' settings):

* ``man-table2``: FedAvg, FedSAM, FedDyn, FedDC, each with and without MAN, Dirichlet delta 0.3 and 0.6
  (MAN Table 2: top Hessian eigenvalue and trace; MAN Fig. 4 for the FedAvg and FedSAM pairs);
* ``man-table6``: FedASAM and FedSpeed with and without MAN (MAN supplementary Table 6);
* ``man-tables``: both MAN tables (24 runs); the runs of a preset live in one folder, so running ``man-table2`` then
  ``man-table6`` trains nothing twice;
* ``fedalign-table1``: FedAvg, FedProx, MOON, and FedAvg with Mixup, StochDepth, GradAug and FedAlign on the FedML
  Dirichlet 0.5 split, with cross-client H_N / H_D (FedAlign Table 1).

Presets (:data:`PRESETS`):

* ``paper``: the papers' settings. MAN (paper Sec. 4, supplementary Sec. 7, docs/update-rules.md §0): CIFAR-100 and
  the MAN CNN, 100 clients, each joining a round with probability 0.1, 500 rounds, lr 0.1 decayed by 0.998 per
  round, batch 50, 5 local epochs, weight decay 1e-3, gradient clipping at 10; zeta 0.15 (main paper, for CIFAR-100)
  except FedAvg+MAN, zeta 0.6 (supplementary Sec. 7), in the fedMAN code's convention (loss = CE + zeta/2 * sum);
  FedDyn and FedDC alpha 0.01; FedSAM rho 0.05; FedASAM rho 0.5, eta 0.2; FedSpeed rho 0.1, lambda 0.01.
  Hessian: PyHessian's protocol (docs/update-rules.md §21: power iteration and Hutchinson, 100 iterations, tol 1e-3,
  the whole training set), and for MAN Fig. 4 the top 200 eigenvalues (Lanczos) and the spectral density.
  FedAlign (paper Sec. 3.2, docs/update-rules.md §18-19): CIFAR-100, ResNet-56, 16 clients all participating, FedML Dirichlet 0.5,
  25 rounds x 20 local epochs, lr 0.01 (constant), momentum 0.9 Nesterov, weight decay 1e-4, batch 64; FedProx
  mu 1e-4, MOON mu 1 tau 0.5, Mixup gamma 0.1, StochDepth last survival 0.9, GradAug mu 1.75 with 2 sub-networks
  and minimum width 0.8, FedAlign mu 0.45 width 0.25 (clipping at 10 for FedAlign as in its code, none for the
  others); H_N / H_D with the ``fedalign`` protocol; loss surfaces along the top-2 Hessian eigenvectors (Fig. 1).
  Needs the dataset (``--data-dir``) and, realistically, a GPU (``--device cuda``).
* ``quick``: the same grids scaled down to the embedded digits (1,797 8x8 images) on a laptop CPU, three seeds
  (0, 1, 2) by default: MAN with the digits CNN, 20 clients joining with probability 0.5 (10 per round, as in the
  paper), 30 rounds x 2 local epochs, the paper's optimiser settings and hyper-parameters; Hessian by Lanczos (top
  eigenvalue) and Hutch++ (trace, 60 Hessian-vector products) on the whole digits training split (1,442 images);
  for the Fig. 4 pairs the top 50 eigenvalues and the density (2 SLQ starts x 80 steps) of the first seed only
  (``man-tables``: 72 runs; their time is in docs/reproductions.md). FedAlign with ResNet-20 on digits, 16 clients, 10 rounds x 2 local epochs.
* ``fmnist``: the MAN tables on Fashion-MNIST (all 60,000 images over the paper's 100 clients, Bernoulli 0.1, 20
  rounds x 2 local epochs) with an MLP 784-64-64-10, three seeds; ``fmnist-cnn``: the same with the MAN CNN at
  LeNet-5 widths (``cifar-cnn``, channels 6/16, hidden 120/84).
* ``tiny``: the same grids for seconds-long tests (2 rounds, 4 clients, a few probes).

Which code each preset follows (:data:`CODE_FOLLOWED`; the same in every preset, since a table's numbers come from
one code). The MAN tables were produced with the fedMAN code, so every MAN run follows it:

=========  ===========================================================================================================
FedAvg     fedMAN/FedDyn ``train_FedAvg``: flatfl's ``fedavg`` is that code (no switch)
FedSAM     fedMAN ``man_code_sam`` SAM minimiser: flatfl's SAM (no switch)
FedASAM    fedMAN ``man_code_sam`` ASAM minimiser: flatfl's ASAM (no switch)
FedDyn     fedMAN ``train_feddyn_mdl``: flatfl's ``feddyn`` (no switch)
FedDC      fedMAN/FedDC ``train_FedDC``: ``--cv-lr initial`` (the code divides the g_i update by the undecayed lr)
           and ``--steps-rule mean`` (by ``E * ceil(mean(n) / B)``; identical to the default on the equal-size
           Dirichlet split, set so the run is the code's on any split); flatfl's defaults are the papers' intent
FedSpeed   fedMAN ``train_model_speed`` (lambda = alpha / w_i); its speedOpt's leftover gradient in the ascent step
           (no ``zero_grad``) is a bug and is not reproduced
MAN        fedMAN's penalty, loss = CE + (zeta/2) sum_l mean(a_l^2) over the same post-ReLU activations
=========  ===========================================================================================================

FedAlign Table 1 follows the FedAlign code (FedML-based): its partition, optimiser, clipping for FedAlign only, and
the ``fedalign`` protocol of H_N / H_D. It has no SCAFFOLD or FedDC run, so ``--cv-lr`` / ``--steps-rule`` do not
arise; SCAFFOLD used elsewhere (``flatfl train``) keeps flatfl's defaults unless asked.

``methods``: any subset of a table's rows by name (``--methods FedAvg,FedAvg+MAN``), for a reduced reproduction in
one command; the report then fills only those rows, and shows only the tables they belong to.

Layout: the runs in ``RUNS_DIR/<method>-<partition>-s<seed>/`` (default ``runs/reproduce-<preset>``), the report in
``OUT`` (default ``reports/<target>-<preset>``). A reproduction restricted by ``methods`` or by seeds other than the
preset's has a default ``OUT`` of its own, ``reports/<target>-<preset>-<selection>`` (:func:`default_out`), so it
never replaces the full report; and no reproduction writes its report over one in ``OUT`` that holds runs it does
not run (:func:`check_out`: one error line naming ``--out``, before any training). Re-running skips finished runs
and analyses and resumes unfinished runs, so an interrupted reproduction continues where it stopped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from . import paper_tables
from .errors import ConfigError, unknown_name
from .paper_tables import man_common
from .paper_tables.table_spec import Method, PaperTable
from .sweep import SECTION_SETTINGS, RunTask, run_tasks

__all__ = ["TARGETS", "PRESETS", "CODE_FOLLOWED", "FEDDC_OFFICIAL", "Selection", "RunOptions", "plan", "reproduce",
           "Method", "PaperTable", "tables_of", "methods_of", "Progress", "default_out", "check_out", "REPORTS_DIR",
           "execution_order", "task_weight", "run_stage"]

#: where reports go when no ``out`` is given (:func:`default_out`)
REPORTS_DIR = Path("reports")

PRESETS = paper_tables.PRESETS
DEFAULT_SEEDS = paper_tables.DEFAULT_SEEDS
#: torch threads per run when ``--threads`` is not given: fixed, not taken from the machine's load, because the
#: thread count changes the order of floating-point sums and so the numbers (see README, "Reproducing")
REPRODUCE_THREADS = 1
#: what ``flatfl reproduce`` makes: one module per table in :mod:`flatfl.paper_tables`, and their groups
TARGETS = paper_tables.TARGETS
FEDDC_OFFICIAL = man_common.FEDDC_OFFICIAL

#: Per method of the tables: the code whose behaviour every preset follows, and what that takes here.
CODE_FOLLOWED = {k: v for t in paper_tables.REPRODUCED.values() for k, v in t.code_followed.items()}


@dataclass(frozen=True)
class Selection:
    """What a reproduction selects: the table or group of tables (``target``, one of :data:`TARGETS`), the
    ``preset``, the ``seeds`` (None: the preset's, :data:`DEFAULT_SEEDS`), the rows (``methods``: names of the
    tables' rows, a comma-separated string or a list, see :func:`methods_of`; None: every row) and the ``model``
    its analyses and tables measure, 'server' or 'clients-average' (None: the one its tables report,
    :func:`flatfl.report.layouts.model_for`: the all-clients average for the MAN tables, the server model for
    FedAlign's). Checked by :func:`plan`."""
    target: str
    preset: str = "quick"
    seeds: tuple[int, ...] | None = None
    methods: str | tuple[str, ...] | None = None
    model: str | None = None


@dataclass(frozen=True)
class RunOptions:
    """What every run of a reproduction is given besides its preset's settings: where it computes (``device``,
    torch ``threads`` per run: None gives :data:`REPRODUCE_THREADS` in :func:`reproduce`, torch's default in a
    task of :func:`plan`), its dataset folder (``data_dir``), the curvature every K rounds (``track_hessian``, ``flatfl
    train --track-hessian``, 0: off; None: the preset's) and its floating type (``precision``; None: the preset's,
    float64 on the CPU presets, float32 on ``paper`` and ``tiny``). Checked by :func:`plan`."""
    device: str = "cpu"
    data_dir: str | None = None
    threads: int | None = None
    track_hessian: int | None = None
    precision: str | None = None


def tables_of(target: str) -> tuple[str, ...]:
    """The keys of the tables ``target`` (a table or a group) names."""
    return paper_tables.GROUPS.get(target, (target,))


def methods_of(target: str) -> tuple[str, ...]:
    """The row names (methods) of the tables ``target`` names, in table order."""
    return tuple(dict.fromkeys(m.label for key in tables_of(target) for m in paper_tables.REPRODUCED[key].methods))


def _chosen_methods(target: str, methods) -> set[str] | None:
    """The methods asked for (a comma-separated string or a list; names matched ignoring case), None for all; an
    unknown name is one ConfigError line listing the valid ones."""
    if methods is None:
        return None
    names = [n.strip() for n in (methods.split(",") if isinstance(methods, str) else methods) if str(n).strip()]
    valid = methods_of(target)
    lookup = {v.lower(): v for v in valid}
    unknown = [n for n in names if str(n).lower() not in lookup]
    if unknown or not names:
        what = f"unknown method(s) {', '.join(map(repr, unknown))}" if unknown else "no method named"
        raise ConfigError(f"--methods: {what} for {target}; choose from {', '.join(valid)}")
    return {lookup[str(n).lower()] for n in names}


def _selection(target: str, preset: str, methods=None, seeds=None) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """What a restricted reproduction leaves out: (the rows asked for, in table order, or () for all; the seeds
    asked for, or () for the preset's)."""
    chosen = _chosen_methods(target, methods)
    rows = () if chosen is None or set(chosen) == set(methods_of(target)) else \
        tuple(m for m in methods_of(target) if m in chosen)
    own = () if seeds is None or sorted(set(seeds)) == sorted(set(DEFAULT_SEEDS[preset])) else tuple(seeds)
    return rows, own


def _setting_parts(target: str, preset: str, model: str | None, track_hessian: int | None) -> list[str]:
    """What a reproduction's report folder name adds for the settings that change the report's content besides
    its runs: another model than the table reports (``model-server``), another curvature tracking than the
    preset's (``track5``)."""
    from .report.layouts import model_for

    key = tables_of(target)[0]
    parts = []
    if model is not None and model != model_for(paper_tables.TABLES[key], None):
        parts.append(f"model-{model}")
    preset_track = paper_tables.REPRODUCED[key].presets.get(preset, {}).get("run", {}).get("track_hessian", 0)
    if track_hessian is not None and track_hessian != preset_track:
        parts.append(f"track{track_hessian}")
    return parts


def default_out(target: str, preset: str, methods=None, seeds=None, model: str | None = None,
                track_hessian: int | None = None) -> Path:
    """The report folder when none is given: ``REPORTS_DIR/<target>-<preset>`` for the whole table; a reproduction
    restricted by ``methods`` or by other seeds than the preset's gets one of its own, named after the selection
    (``man-tables-quick-fedavg_fedavg-man-s0-1``; a short digest of it where that name would be long), so that it
    never replaces the full report; so does one measuring another model than the table's (``-model-server``) or
    tracking curvature otherwise than the preset (``-track5``)."""
    rows, own = _selection(target, preset, methods, seeds)
    settings = _setting_parts(target, preset, model, track_hessian)
    base = f"{target}-{preset}"
    if not rows and not own and not settings:
        return REPORTS_DIR / base
    parts = ([("_".join(_slug(m) for m in rows))] if rows else []) + (
        ["s" + "-".join(str(s) for s in own)] if own else []) + settings
    name = "-".join(parts)
    if len(name) > 60:
        import hashlib

        name = "subset-" + hashlib.sha256(repr((rows, own, settings)).encode()).hexdigest()[:10]
    return REPORTS_DIR / f"{base}-{name}"


def _measured(target: str, model: str | None) -> str:
    """The model a reproduction of ``target`` measures (``model``, else the one its tables report)."""
    from .report.layouts import model_for

    return model_for(paper_tables.TABLES[tables_of(target)[0]], model)


def check_out(out: Path, tasks: list[RunTask], model: str | None = None) -> None:
    """Refuse (one ConfigError line naming ``--out``) to write a report into ``out`` when the report already there
    holds runs that ``tasks`` do not run: a reproduction restricted by ``--methods`` or ``--seeds`` never replaces a
    fuller report; nor one measuring another ``model`` than the report there. A report of the same runs or of fewer
    of them is replaced, as re-running does."""
    import csv
    import json

    from .utils.csv_cells import read_csv_cell

    out = Path(out)
    if not (out / "summary.json").is_file():
        return
    ours = {t.name for t in tasks}
    try:
        if (out / "runs.csv").is_file():
            with open(out / "runs.csv", newline="", encoding="utf-8") as f:
                theirs = {read_csv_cell(row.get("run") or "") for row in csv.DictReader(f)}
            count, extra = len(theirs), sorted(theirs - ours)
        else:  # a report without its runs.csv: only its count of runs is known
            count = json.loads((out / "summary.json").read_text(encoding="utf-8")).get("runs")
            extra = ["?"] if isinstance(count, int) and count > len(ours) else []
        theirs_models = json.loads((out / "summary.json").read_text(encoding="utf-8")).get("models") or {}
        other = sorted({str(m) for m in theirs_models.values()} - {model}) if model is not None else []
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        raise ConfigError(f"--out {out} holds a report that cannot be read (summary.json, runs.csv); choose "
                          "another --out or remove it") from None
    if other:
        raise ConfigError(f"--out {out} holds a report measuring the {other[0]} model; this reproduction measures "
                          f"the {model} model and would replace it: choose another --out (without --out, each model's "
                          "report has a folder of its own)")
    if extra:
        which = f", {len(extra)} of them not in this reproduction (e.g. {extra[0]})" if extra != ["?"] else ""
        raise ConfigError(f"--out {out} holds a report of {count} runs{which}; a report of fewer runs would replace "
                          "it: choose another --out (a reproduction restricted by --methods or --seeds has one of "
                          "its own when --out is not given)")


def _slug(label: str) -> str:
    return label.lower().replace("+", "-")


def _run_name(label: str, settings: dict, seed: int) -> str:
    part = settings["partition"]
    part = part if part == "iid" else f"{part}{float(settings['alpha']):g}"
    return f"{_slug(label)}-{part}-s{seed}"


def plan(selection: Selection, runs: RunOptions | None = None, *,
         runs_dir: str | Path | None = None) -> list[RunTask]:
    """The run tasks of the ``selection``'s target at its preset: one per (method, partition, seed), with its
    analyses; with ``selection.methods`` only those rows' runs; each given ``runs`` (:class:`RunOptions`)."""
    target, preset, seeds, methods, model = (selection.target, selection.preset, selection.seeds, selection.methods,
                                             selection.model)
    runs = runs or RunOptions()
    track_hessian, data_dir, precision = runs.track_hessian, runs.data_dir, runs.precision
    if target not in TARGETS:
        raise unknown_name("reproduction target", target, TARGETS)
    if preset not in PRESETS:
        raise unknown_name("preset", preset, PRESETS)
    chosen = _chosen_methods(target, methods)
    seeds = DEFAULT_SEEDS[preset] if seeds is None else tuple(seeds)
    if not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise ConfigError(f"--seeds must be non-negative integers, got {seeds!r}")
    root = Path(runs_dir or Path("runs") / f"reproduce-{preset}").resolve()
    extra = {"device": runs.device}
    if track_hessian is not None:
        if isinstance(track_hessian, bool) or not isinstance(track_hessian, int) or track_hessian < 0:
            raise ConfigError(f"--track-hessian must be an integer >= 0 (0: off), got {track_hessian!r}")
        extra["track_hessian"] = track_hessian
        if track_hessian == 0:  # no tracking: no tracking settings either (a preset may give some)
            extra["track_hessian_settings"] = {}
    if data_dir:
        extra["data_dir"] = str(Path(data_dir).expanduser().resolve())
    if precision is not None:
        from .utils.precision import check_precision

        extra["precision"] = check_precision(precision)
    from .report.layouts import model_for

    keys = tables_of(target)
    model = model_for(paper_tables.TABLES[keys[0]], model)
    tasks: list[RunTask] = []
    for key in keys:
        table = paper_tables.REPRODUCED[key]
        if preset not in table.presets:
            raise ConfigError(f"{key} has no preset {preset!r}: choose one of {', '.join(table.presets)}")
        cfg = table.presets[preset]
        for m in table.methods:
            if chosen is not None and m.label not in chosen:
                continue
            for alpha in table.alphas or (None,):
                for seed in seeds:
                    settings = dict(cfg["run"], **({} if alpha is None else {"alpha": alpha}), seed=seed)
                    settings.update(m.settings)
                    settings.update(extra)
                    with_spectrum = cfg.get("spectrum_seeds") != "first" or seed == seeds[0]
                    tasks.append(_task(m, settings, seed, root, cfg, runs, model, with_spectrum))
    return tasks


def _task(m: Method, settings: dict, seed: int, root: Path, cfg: dict, runs: RunOptions,
          model: str = "server", with_spectrum: bool = True) -> RunTask:
    from .train.config import normalize_settings

    device, threads = runs.device, runs.threads
    name = _run_name(m.label, settings, seed)
    hessian = dict(cfg["hessian"], seed=seed, device=device)
    spectrum = dict(cfg["spectrum"], seed=seed, device=device) if m.spectrum and with_spectrum and "spectrum" in cfg \
        else None
    clients = dict(cfg["clients"], seed=seed, device=device) if cfg.get("clients") else None
    surface = dict(cfg["surface"], seed=seed, device=device) if cfg.get("surface") else None
    for section, options in (("hessian", hessian), ("spectrum", spectrum), ("clients", clients), ("surface", surface)):
        if options is not None:  # the preset's analysis settings, typed and checked before any run
            SECTION_SETTINGS[section].from_mapping(options, f"the {section} settings of {name}")
    return RunTask(name=name, run_dir=str(root / name), settings=normalize_settings(settings, source=name),
                   hessian=hessian, spectrum=spectrum, clients=clients, surface=surface, threads=threads,
                   model=model)


def check_run_folders(out: Path, tasks: list[RunTask], tables) -> None:
    """Before any run trains, one ConfigError line for what would stop the reproduction only after hours of
    training: a file of the user's in ``out`` under a name the report writes, or a folder in a run's place that is
    not that run (no flatfl run, or a run with other settings)."""
    from .report.pipeline import report_files
    from .sweep import run_state
    from .train.config import build_config
    from .utils.manifest import refuse_foreign

    refuse_foreign(out, report_files([paper_tables.TABLES[k] for k in tables]))
    for t in tasks:
        run_state(t.run_dir, expected=build_config({}, dict(t.settings, out=t.run_dir)))


def reproduce(selection: Selection, runs: RunOptions | None = None, *, out: str | Path | None = None,
              runs_dir: str | Path | None = None, executor=None, echo: Callable[[str], None] | None = None,
              progress_bar: bool = False) -> dict:
    """Train and analyse every run the ``selection`` names (its tables' rows at its preset, :func:`plan`; skipping
    finished work), each given ``runs`` (:class:`RunOptions`), then write the report into ``out``. Returns the
    report's summary plus 'tasks' (what each run did) and 'seconds'.

    Progress: one line per run ending, with the time elapsed and an estimate of the time left across the runs
    (:class:`Progress`); ``progress_bar``: a tqdm bar instead (on a terminal), the lines printed above it.

    ``runs.threads``: torch threads per run, default :data:`REPRODUCE_THREADS` (pinned, whatever the machine's
    load; recorded in each run's config.json). ``executor``: default one run at a time in a worker process."""
    from .executors import LocalExecutor
    from .report import build_report

    from .utils.threads import check_threads

    target, preset, seeds, methods, model = (selection.target, selection.preset, selection.seeds, selection.methods,
                                             selection.model)
    runs = runs or RunOptions()
    check_threads(runs.threads)
    start = time.perf_counter()
    executor = executor or LocalExecutor(1)
    if runs.threads is None:
        runs = replace(runs, threads=REPRODUCE_THREADS)
    tasks = plan(selection, runs, runs_dir=runs_dir)
    out = Path(out) if out else default_out(target, preset, methods, seeds, model, runs.track_hessian)
    rows, _ = _selection(target, preset, methods, seeds)
    tables = tuple(key for key in tables_of(target)  # a restricted reproduction: only the tables of its rows
                   if not rows or any(m.label in rows for m in paper_tables.REPRODUCED[key].methods))
    check_out(out, tasks, model=_measured(target, model))  # before any run trains: a fuller report, a file of the user's, a folder in a run's place
    check_run_folders(out, tasks, tables)
    if echo:
        echo(f"{target} ({preset}): {len(tasks)} runs in {Path(tasks[0].run_dir).parent}, report in {out}")
    progress = Progress(tasks, echo, bar=progress_bar, heartbeat=HEARTBEAT_SECONDS) if echo else None
    order = execution_order(tasks, getattr(executor, "workers", 1))
    try:
        started = run_tasks([tasks[i] for i in order], executor, echo=echo,
                            on_done=progress.done if progress else None)
    finally:
        if progress:
            progress.close()
    by_name = {r["name"]: r for r in started}
    records = [by_name[t.name] for t in tasks if t.name in by_name]
    failed = [r for r in records if r.get("error")]
    done = [t.run_dir for t in tasks if Path(t.run_dir, "config.json").is_file()]
    if not done:
        raise ConfigError(f"no run of {target} could start; first error: {failed[0]['error'] if failed else '?'}")
    summary = build_report(done, out, tables=tables, title=f"flatfl reproduce {target} --preset {preset}",
                           echo=echo, model=model, rows=rows or None)
    summary["tasks"] = records
    summary["out"] = str(out)
    summary["failed"] = [f"{r['name']}: {r['error']}" for r in failed]
    summary["seconds"] = round(time.perf_counter() - start, 1)
    return summary


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 120:
        return f"{s} s"
    return f"{s // 60} min {s % 60:02d} s" if s < 7200 else f"{s // 3600} h {s % 3600 // 60:02d} min"


#: a run's work in the time-left estimate, in runs without the spectrum: the spectrum (the top eigenvalues and the
#: density of MAN Fig. 4) costs about this many more (on the quick preset a spectrum took 51 s, a run without it
#: 14-16 s: benchmarks/main_job_cost.py, docs/performance.md); the estimate is a rate, so only the ratio matters
SPECTRUM_WEIGHT = 3.5
#: seconds without a line after which the progress says which runs are under way and how far each is
HEARTBEAT_SECONDS = 25.0


def task_weight(task) -> float:
    """The run's share of the work (:data:`SPECTRUM_WEIGHT`)."""
    return 1.0 + (SPECTRUM_WEIGHT if task.spectrum is not None else 0.0)


def execution_order(tasks, workers: int) -> list[int]:
    """The order the runs start in: one light run per worker first (a first line within seconds), then the rest
    heaviest first (the spectrum runs early, light ones at the end fill the workers evenly); stable otherwise."""
    light = [i for i, t in enumerate(tasks) if t.spectrum is None][:max(1, workers)]
    rest = sorted((i for i in range(len(tasks)) if i not in light), key=lambda i: -task_weight(tasks[i]))
    return light + rest


def run_stage(task, since: float) -> str | None:
    """How far a run under way is, read off its folder ('training, round 20 of 30', 'hessian', 'spectrum'); None
    when its folder has not changed since ``since`` (time.time()): not started by this reproduction, or waiting."""
    import csv

    from .run_layout import analysis_dir

    folder = Path(task.run_dir)
    try:
        metrics = folder / "metrics.csv"
        changed = max((p.stat().st_mtime for p in (folder, metrics, folder / "final.pt") if p.exists()), default=0)
        if changed < since:
            return None
        rounds = task.settings.get("rounds")
        if not (folder / "final.pt").is_file():
            last = None
            if metrics.is_file():
                with open(metrics, newline="") as f:
                    for row in csv.DictReader(f):
                        last = row.get("round") or last
            return f"training, round {last} of {rounds}" if last else "training"
        for kind in ("hessian", "spectrum"):
            if getattr(task, kind) is not None and not (folder / analysis_dir(kind, task.model) / "hessian.json").is_file():
                return kind
        return "analyses"
    except (OSError, ValueError, csv.Error):
        return None


class Progress:
    """One progress report across the runs of a reproduction: each run's line (from :func:`flatfl.sweep.run_tasks`)
    with the time elapsed and the time left, estimated from the wall time per unit of work so far (a run with the
    spectrum counts :func:`task_weight`). Runs already finished when the reproduction starts (their training is
    skipped) count neither in the rate nor in what is left. Between run lines, every :data:`HEARTBEAT_SECONDS`
    without one, a line says which runs are under way and how far each is (:func:`run_stage`). With ``bar`` (a
    terminal), a tqdm bar on stderr carries the estimate and the lines are printed above it; else the estimate ends
    each line, as a log wants it. ``clock``: seconds, monotonic; ``heartbeat``: seconds, 0 for none."""

    def __init__(self, tasks, echo: Callable[[str], None], bar: bool = False,
                 clock: Callable[[], float] = time.perf_counter, heartbeat: float = 0.0):
        import threading

        from .sweep import run_state

        self.echo, self.total, self.clock = echo, len(tasks), clock
        self.start = clock()
        self.since = time.time()
        self.tasks = list(tasks)

        def finished(t) -> bool:
            try:
                return run_state(t.run_dir) == "finished"
            except ConfigError:  # reported by the run itself
                return False

        self.ready = {t.name for t in tasks if finished(t)}
        self.left = self.total - len(self.ready)  # runs to train
        self.work_left = sum(task_weight(t) for t in tasks if t.name not in self.ready)
        self.work_done = 0.0
        self.trained = 0
        self.ended: set[str] = set()
        self.estimate: tuple[float, float | None] = (0.0, None)  # (elapsed, time left) at the last run line
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=self.left, unit="run", desc="runs to train", dynamic_ncols=True, leave=False)
        self.lock = threading.Lock()
        self.last_line = time.monotonic()  # the heartbeat's own clock, apart from the estimate's
        self.stop = threading.Event()
        self.thread = None
        if heartbeat > 0 and self.left > 0:
            self.thread = threading.Thread(target=self._beat, args=(heartbeat,), daemon=True, name="flatfl-progress")
            self.thread.start()

    def eta(self, elapsed: float) -> float | None:
        """Seconds left after ``elapsed``: the wall time per unit of work trained so far times the work left to
        train (None before a run trained)."""
        return elapsed / self.work_done * self.work_left if self.work_done else None

    def _when(self, elapsed: float, eta: float | None = None) -> str:
        eta = self.eta(elapsed) if eta is None else eta
        return f"{_duration(elapsed)} elapsed, " + (
            "no run left to train" if self.left <= 0 else f"about {_duration(eta)} left" if eta is not None else
            "time left known after the first run trained")

    def _say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            self.echo(line)
        self.last_line = time.monotonic()

    def done(self, task, record: dict, line: str) -> None:
        """Called by :func:`flatfl.sweep.run_tasks` as each run ends, with its line."""
        with self.lock:
            self.ended.add(task.name)
            trained = task.name not in self.ready
            if trained:
                self.trained += 1
                self.left -= 1
                self.work_done += task_weight(task)
                self.work_left -= task_weight(task)
            if self.bar is not None:
                self._say(line)
                if trained:
                    self.bar.update(1)
                return
            first, _, rest = line.partition("\n")
            elapsed = self.clock() - self.start
            self.estimate = (elapsed, self.eta(elapsed))
            self._say(f"{first} | {self._when(elapsed)}" + (f"\n{rest}" if rest else ""))

    def under_way(self) -> list[str]:
        """'name (stage)' of each run under way (:func:`run_stage`), in plan order."""
        out = []
        for t in self.tasks:
            if t.name in self.ended or t.name in self.ready:
                continue
            stage = run_stage(t, self.since)
            if stage is not None:
                out.append(f"{t.name} ({stage})")
        return out

    def heartbeat(self) -> str | None:
        """The line saying which runs are under way (None when none is seen yet)."""
        runs = self.under_way()
        if not runs:
            return None
        done = f"{self.trained} of {self.trained + self.left} runs trained"
        elapsed = self.clock() - self.start
        at, eta = self.estimate
        # the estimate of the last run line, less the time since (runs under way have done work it cannot see yet)
        eta = None if eta is None else max(eta - (elapsed - at), 0.0)
        return f"... {done}; under way: {', '.join(runs)} | {self._when(elapsed, eta)}"

    def _beat(self, every: float) -> None:
        while not self.stop.wait(min(every, 5.0)):
            with self.lock:
                if time.monotonic() - self.last_line < every:
                    continue
                line = self.heartbeat()
                if line is not None:
                    self._say(line)

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=10)
        if self.bar is not None:
            self.bar.close()
