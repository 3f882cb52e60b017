"""Sweeps: a grid of runs (algorithms x regularizers x partitions x seeds x ...) as independent, resumable tasks.

One task = one run directory: train it (or resume it, or skip it when finished), then the analyses asked for
(Hessian spectrum and trace, cross-client H_N / H_D, a loss surface), each skipped when its result is already there
with the same settings. Tasks go to any executor of :mod:`flatfl.executors` (serial, process pool, Ray); a sweep
killed at any point continues where it stopped when run again, since the engine resumes runs from ``resume.pt``.

Grid file (TOML or YAML)::

    out = "runs/man-grid"        # root of the run directories (default: runs/<file name without suffix>)
    seeds = [0, 1]               # optional; the same as a 'seed' list under [grid]
    threads = 1                  # optional: torch threads per run (default: flatfl.executors.default_threads)

    [fixed]                      # settings shared by every run: flatfl train's options and hyper-parameter flags
                                 # (a hyper-parameter here goes to the runs whose pieces read it, e.g. zeta to the
                                 # MAN runs; one that no run reads is an error, as is one set for a run in [grid]
                                 # or [[include]] that the run does not read)
    dataset = "digits"
    rounds = 30
    precision = "float64"        # optional: the runs' floating type (default float32; --precision overrides it)

    [grid]                       # every combination of these lists is one run
    algo = ["fedavg", "feddyn"]
    reg = ["none", "man"]
    alpha = [0.3, 0.6]

    [[include]]                  # extra single runs: [fixed] plus these settings
    algo = "fedsam"
    reg = "man"

    [hessian]                    # optional: flatfl hessian on each final model (its option names)
    top = 1
    samples = 512

    [spectrum]                   # optional: a second Hessian analysis kept apart (e.g. top = 200, density = true)

    [clients]                    # optional: H_N / H_D (flatfl hessian-clients options); needs save_clients
    protocol = "default"

    [surface]                    # optional: a loss surface (flatfl surface options)
    grid = 11

A run's directory is named after the settings that vary across the sweep (``algo-fedavg__reg-man__seed-0``).

Python API: :func:`read_grid`, :func:`expand_grid`, :class:`RunTask`, :func:`run_task`, :func:`run_tasks`,
:func:`run_sweep`, :func:`run_state`.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from .errors import CheckpointError, ConfigError
from .analysis.commands.client_metrics_settings import ClientMetricsSettings
from .analysis.commands.hessian_settings import HessianSettings, tracking_settings
from .analysis.commands.surface_settings import SurfaceSettings
from .run_layout import (CLIENTS_DIR, HESSIAN_DIR, MODEL_CHECKPOINTS, SPECTRUM_DIR, SURFACE_DIR, analyse_run,  # noqa: F401
                   analysis_dir, model_checkpoint, settings_match)

__all__ = ["RunTask", "run_task", "analyse_run", "run_tasks", "run_state", "read_grid", "expand_grid", "run_sweep",
           "SweepGrid", "HESSIAN_DIR", "SPECTRUM_DIR", "CLIENTS_DIR", "SURFACE_DIR", "MODEL_CHECKPOINTS",
           "analysis_dir", "model_checkpoint", "settings_match"]



# ---------------------------------------------------------------------------------------------- one task
@dataclass
class RunTask:
    """Everything one run needs, picklable: the run's settings (RunConfig fields; hyper-parameters under
    ``params``), its directory, and the analyses to run on its final model (keyword arguments of
    :func:`~flatfl.analysis.commands.hessian_command.run_hessian`, :func:`~flatfl.analysis.commands.clients_command.run_client_metrics`,
    :func:`~flatfl.analysis.commands.surface_command.run_surface`; None = skip)."""

    name: str
    run_dir: str
    settings: dict
    hessian: dict | None = None
    spectrum: dict | None = None
    clients: dict | None = None
    surface: dict | None = None
    threads: int | None = None  # torch intra-op threads inside the task (None: leave torch's default)
    quiet: bool = True
    model: str = "server"  # the model the Hessian, spectrum and surface analyses measure (MODEL_CHECKPOINTS)


def run_state(run_dir: str | Path, expected=None) -> str:
    """'new' (nothing there), 'partial' (started, not finished) or 'finished'. With ``expected`` (a RunConfig),
    a directory holding a run with other settings raises :class:`ConfigError` naming the first differences."""
    d = Path(run_dir)
    if not d.exists() or (d.is_dir() and not any(not _leftover(p.name) for p in d.iterdir())):
        return "new"  # empty, or only what a writer stopped before its first file leaves: its lock, a temporary
    if not d.is_dir():
        raise ConfigError(f"{d} exists and is not a directory")
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{d} exists but is not a flatfl run (no config.json); move it or choose another out")
    try:
        record = json.loads(cfg_file.read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        raise ConfigError(f"{cfg_file} is corrupt; delete {d} to start the run again") from None
    from .utils.manifest import is_run_record

    if not is_run_record(record):
        raise ConfigError(f"{d} exists but is not a flatfl run (its config.json is not flatfl's); move it or choose "
                          "another out")
    stored = record["config"]
    if expected is not None:
        from .train.identity import run_settings
        from .utils.run_identity import differing_keys

        want, have = run_settings(expected.to_dict()), run_settings(stored)
        diff = differing_keys(want, have)
        if diff:
            shown = ", ".join(f"{k}: {have.get(k)!r} there, {want.get(k)!r} asked" for k in diff[:3])
            raise ConfigError(f"{d} holds a run with other settings ({shown}); delete it or choose another out")
    return "finished" if (d / "final.pt").is_file() else "partial"


def _leftover(name: str) -> bool:
    """A run folder's lock file, its manifest or a flatfl temporary (``.NAME.PID.XXXXXXXX.tmp``): all that a run
    stopped (Ctrl-C, kill) between taking its folder's lock and writing config.json leaves behind (the manifest
    claims config.json just before the file is moved into place; alone, it lists only files that are not there)."""
    from .utils.atomic import TEMPORARY_NAME
    from .utils.lock import LOCK_NAME
    from .utils.manifest import MANIFEST

    return name in (LOCK_NAME, MANIFEST) or bool(TEMPORARY_NAME.match(name))


def _train(task: RunTask, log: Callable[[str], None]) -> str:
    from .analysis.commands.tracking import curvature_observer
    from .train.config import build_config
    from .train.engine import Trainer
    from .train.run_folder import recover_final

    cfg = build_config({}, dict(task.settings, out=task.run_dir))
    run_dir = Path(task.run_dir)
    state = run_state(run_dir, expected=cfg)
    if state == "finished":
        return "skipped"
    if state == "partial":
        # The engine resumes from resume.pt (or from round 0 when killed before the first checkpoint). A resume.pt
        # that says "finished" means only final.pt was lost: the engine writes it again (recover_final).
        Trainer(cfg, run_dir, resume=True, quiet=task.quiet, log=log, observer=curvature_observer(cfg)).run()
        if not (run_dir / "final.pt").is_file() and not recover_final(run_dir, cfg.rounds):
            raise CheckpointError(f"{run_dir}: resume.pt says finished but neither final.pt nor the last round's "
                                  "checkpoint exists; delete resume.pt to train again")
        return "resumed"
    Trainer(cfg, run_dir, quiet=task.quiet, log=log, observer=curvature_observer(cfg)).run()
    return "trained"


def run_task(task: RunTask) -> dict:
    """Train (or resume, or skip) one run, then its analyses. Returns what was done and how long it took.

    Seeding happens here, inside the task (the engine seeds python, numpy and torch from the run's seed; every
    analysis takes its own seed), so the result does not depend on the executor or on other tasks.
    """
    import torch

    if task.threads:
        from .utils.threads import apply_threads

        apply_threads(int(task.threads))
    start = time.perf_counter()
    lines: list[str] = []
    log = lines.append if task.quiet else (lambda s: print(f"[{task.name}] {s}", file=sys.stderr, flush=True))
    out = {"name": task.name, "run_dir": task.run_dir, "train": _train(task, log)}
    out.update(analyse_run(task.run_dir, hessian=task.hessian, spectrum=task.spectrum, clients=task.clients,
                           surface=task.surface, quiet=task.quiet, model=task.model))
    out["seconds"] = round(time.perf_counter() - start, 3)
    return out


def preflight(tasks: list[RunTask]) -> None:
    """Check once, on this machine, what every unfinished run needs from it: its device and its dataset. A missing
    GPU or data set is then one error line (exit 2) instead of the same failure once per run. Only for the local
    executor: on a cluster the driver need not have the workers' GPUs or data."""
    from .train.config import build_config
    from .data import load_dataset
    from .utils.device import resolve_device

    checked: set = set()
    for t in tasks:
        try:
            if run_state(t.run_dir) == "finished":
                continue
            cfg = build_config({}, t.settings)
        except ConfigError:
            continue  # the task reports it itself
        if ("device", cfg.device) not in checked:
            resolve_device(cfg.device)
            checked.add(("device", cfg.device))
        data = ("data", cfg.dataset, str(Path(cfg.data_dir).expanduser().resolve()))
        if data not in checked:
            load_dataset(cfg.dataset, cfg.data_dir)
            checked.add(data)


def run_tasks(tasks: list[RunTask], executor=None, *, echo: Callable[[str], None] | None = None,
              on_done: Callable[[RunTask, dict, str], None] | None = None) -> list[dict]:
    """Run every task on ``executor`` (default: serial); returns one record per task, in the tasks' order, with
    ``error`` set for the failed ones (the others still run). ``on_done(task, record, line)``, when given, is called
    as each task ends, with the line ``echo`` would print, instead of ``echo``."""
    from .executors import LocalExecutor

    executor = executor or LocalExecutor(1)
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"two runs share the name(s) {', '.join(dup[:3])}")
    if executor.name == "local":
        preflight(tasks)
    records: list[dict | None] = [None] * len(tasks)
    done = 0
    last_error = None
    # closed on any exception here (Ctrl-C while a line is printed included): the executor's pool then stops its
    # workers at once, not when the interpreter collects the generator after waiting for them
    with contextlib.closing(executor.map(run_task, tasks)) as outcomes:
        for outcome in outcomes:
            task = tasks[outcome.index]
            done += 1
            if outcome.ok:
                rec = dict(outcome.result, error=None)
                what = ", ".join(f"{k} {rec[k]}" for k in ("train", "hessian", "clients", "spectrum", "surface")
                                 if rec.get(k))
                msg = f"[{done}/{len(tasks)}] {task.name}: {what} ({rec['seconds']:.1f} s)"
            else:
                rec = {"name": task.name, "run_dir": task.run_dir, "train": None, "hessian": None, "clients": None,
                       "spectrum": None, "surface": None, "seconds": None, "error": outcome.error}
                same = outcome.error == last_error and not outcome.details
                msg = f"[{done}/{len(tasks)}] {task.name}: FAILED: " + ("the same error" if same else outcome.error)
                if outcome.details:
                    msg += "\n" + outcome.details.rstrip()
                last_error = outcome.error
            records[outcome.index] = rec
            if on_done:
                on_done(task, rec, msg)
            elif echo:
                echo(msg)
    return [r for r in records if r is not None]


# ---------------------------------------------------------------------------------------------- grid files
@dataclass
class SweepGrid:
    """A parsed grid file: the run tasks and where they live."""

    root: Path
    tasks: list[RunTask] = field(default_factory=list)


# the typed settings of each analysis section of a grid file
SECTION_SETTINGS = {"hessian": HessianSettings, "spectrum": HessianSettings, "clients": ClientMetricsSettings,
                    "surface": SurfaceSettings}
_GRID_SECTIONS = {"out", "seeds", "fixed", "grid", "include", "hessian", "spectrum", "clients", "surface",
                  "threads"}


def _as_list(key: str, value: Any, source: str) -> list:
    if isinstance(value, list):
        if not value:
            raise ConfigError(f"[grid] {key} in {source} is an empty list")
        return value
    return [value]


def _slug(value: Any) -> str:
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return re.sub(r"[^A-Za-z0-9.+=-]+", "_", text).strip("_") or "x"


def _load_grid_file(path: Path) -> dict:
    from .train.config import read_settings_file

    return read_settings_file(path, "grid file")


MAX_GRID_RUNS = 10_000  # runs one grid may expand to: counted before any run is built


def expand_grid(raw: dict, *, root: str | Path, source: str = "grid") -> list[RunTask]:
    """The run tasks of a parsed grid (see the module docstring for the layout)."""
    from .train.config import build_config, normalize_settings

    unknown = sorted(set(raw) - _GRID_SECTIONS)
    if unknown:
        raise ConfigError(f"unknown section or key {unknown[0]!r} in {source}: use {', '.join(sorted(_GRID_SECTIONS))}")
    for key in ("fixed", "grid", "hessian", "spectrum", "clients", "surface"):
        if key in raw and not isinstance(raw[key], dict):
            raise ConfigError(f"[{key}] in {source} must be a table")
    sections = {key: _section(raw, key) for key in ("hessian", "spectrum", "clients", "surface")}
    for key, options in sections.items():
        if options is not None:
            check_analysis_options(key, options, source)  # a typo fails before any training
    fixed = normalize_settings(raw.get("fixed") or {}, source=f"[fixed] of {source}")
    axes = dict(raw.get("grid") or {})
    spelled = lambda names: {str(k).replace("-", "_"): k for k in names}  # noqa: E731 - data-dir is data_dir
    both = sorted(set(spelled(raw.get("fixed") or {})) & set(spelled(axes)))
    if both:
        raise ConfigError(f"{both[0]} is set in both [fixed] and [grid] of {source}: the grid's values would replace "
                          "the fixed one; keep one")
    if "seeds" in raw:
        if "seed" in axes:
            raise ConfigError(f"{source} sets both 'seeds' and a 'seed' list under [grid]; keep one")
        axes["seed"] = raw["seeds"]
    axes = {k: _as_list(k, v, source) for k, v in axes.items()}
    for k in axes:
        normalize_settings({k: None}, source=f"[grid] of {source}")  # raises on unknown names
    includes = raw.get("include") or []
    if not isinstance(includes, list) or not all(isinstance(x, dict) for x in includes):
        raise ConfigError(f"'include' in {source} must be a list of tables ([[include]] in TOML)")

    size = math.prod(len(v) for v in axes.values()) + len(includes)
    if size > MAX_GRID_RUNS:
        raise ConfigError(f"{source} asks for {size:,} runs; a sweep holds at most {MAX_GRID_RUNS:,} (split the grid "
                          "into several)")
    points: list[dict] = []
    keys = list(axes)
    for combo in itertools.product(*(axes[k] for k in keys)):
        points.append(dict(zip(keys, combo)))
    if not axes and not includes:
        points.append({})
    points += [dict(x) for x in includes]

    varying = [k for k in keys if len(axes[k]) > 1]
    for extra in includes:
        varying += [k for k in extra if k not in varying]
    from .utils.threads import check_threads

    threads = check_threads(raw.get("threads"), f"'threads' in {source}")
    tasks, seen = [], {}
    fixed_used: set[str] = set()
    from .train.config import canonical_method_names

    for point in points:
        point = canonical_method_names(point)  # algo = ["FedAvg", "fedavg"] is one run, named algo-fedavg
        own = normalize_settings(point, source=f"a run of {source}")
        settings = _merge(fixed, own)
        settings = _drop_unused_fixed(settings, set(own.get("params", {})), fixed_used)
        try:
            cfg = build_config({}, settings)  # validate now: a bad value fails before any run starts
            if cfg.track_hessian:  # the tracking settings: checked by the analysis (training only records them)
                tracking_settings(cfg.track_hessian_settings)
        except ConfigError as e:
            where = ", ".join(f"{k}={v}" for k, v in point.items()) or "the fixed settings"
            raise ConfigError(f"{source}, run {where}: {e}") from None
        name = "__".join(f"{_slug(k)}-{_slug(point[k])}" for k in varying if k in point) or "run"
        if name in seen:
            if seen[name] == cfg.to_dict():
                continue
            raise ConfigError(f"two runs of {source} would share the directory name {name!r}")
        seen[name] = cfg.to_dict()
        tasks.append(RunTask(name=name, run_dir=str(Path(root) / name), settings=settings,
                             hessian=_copy(sections["hessian"]), spectrum=_copy(sections["spectrum"]),
                             clients=_copy(sections["clients"]),
                             surface=_copy(sections["surface"]), threads=threads))
    unused = sorted(set(fixed.get("params", {})) - fixed_used)
    if unused:
        from .train.catalog import hparam_declarations

        owners = " / ".join(f"{kind} {name}" for kind, name, _ in hparam_declarations()[unused[0]])
        raise ConfigError(f"[fixed] {unused[0]} in {source}: no run of the grid uses it (a setting of {owners})")
    return tasks


def _drop_unused_fixed(settings: dict, own_params: set, fixed_used: set) -> dict:
    """A [fixed] hyper-parameter applies to the runs whose pieces read it (``zeta`` to the MAN runs of a grid over
    ``reg = ["none", "man"]``) and is left out of the others; a run's own settings are kept (and checked)."""
    from .train.config import RunConfig
    from .train.catalog import used_hparams

    params = settings.get("params") or {}
    try:
        used = used_hparams(settings.get("algo", RunConfig.algo), settings.get("local_opt", RunConfig.local_opt),
                            settings.get("reg", RunConfig.reg))
    except ConfigError:
        return settings  # an unknown name: build_config says which
    fixed_used.update(k for k in params if k in used and k not in own_params)
    kept = {k: v for k, v in params.items() if k in used or k in own_params}
    return dict(settings, params=kept) if "params" in settings else settings


def check_analysis_options(section: str, options: dict, source: str = "grid") -> None:
    """A grid's [hessian] / [spectrum] / [clients] / [surface] options, checked against the analysis's typed
    settings (:class:`~flatfl.analysis.commands.hessian_settings.HessianSettings`,
    :class:`~flatfl.analysis.commands.client_metrics_settings.ClientMetricsSettings`,
    :class:`~flatfl.analysis.commands.surface_settings.SurfaceSettings`): names, types (values coerced in place), then the
    values together, so that a typo or a bad value fails before any run starts."""
    import dataclasses

    from .utils.values import coerce

    settings_class = SECTION_SETTINGS[section]
    where = f"[{section}] of {source}"
    settings_class.check_keys(options, where)
    fields = {f.name: f for f in dataclasses.fields(settings_class)}
    for key, value in options.items():
        f = fields[key]
        hint = str(f.type).replace(" ", "")
        kind = {"bool": bool, "int": int, "float": float, "str": str}.get(hint.split("|")[0])
        if value is None and (f.default is None or hint.endswith("|None")):
            continue
        if kind is not None:
            options[key] = value = coerce(value, kind, f"{key} in [{section}] of {source}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key in (
                "top", "samples", "batch_size", "probes", "groups", "grid", "workers", "trace_hvps",
                "density_steps", "density_starts") and value < (0 if key == "top" else 1):
            raise ConfigError(f"{key} in [{section}] of {source} must be {'>= 0' if key == 'top' else '>= 1'}, "
                              f"got {value!r}")
        if key in ("tol", "trace_rtol") and isinstance(value, (int, float)) and not 0 < value < 1:
            raise ConfigError(f"{key} in [{section}] of {source} must be in (0, 1), got {value!r}")
        if key == "seed" and isinstance(value, int) and not 0 <= value <= 2**32 - 1:
            raise ConfigError(f"seed in [{section}] of {source} must be in 0..{2**32 - 1}, got {value!r}")
    try:  # the values together (a method, a split, a protocol...)
        settings_class.from_mapping(options, where)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _copy(options: dict | None) -> dict | None:
    return None if options is None else dict(options)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if k == "params":
            out["params"] = dict(base.get("params", {}), **v)
        else:
            out[k] = v
    return out


def _section(raw: dict, key: str) -> dict | None:
    if key not in raw:
        return None
    return {str(k).replace("-", "_"): v for k, v in (raw[key] or {}).items()}


def read_grid(path: str | Path, out: str | Path | None = None, precision: str | None = None) -> SweepGrid:
    """Parse a grid file; ``out`` overrides its ``out`` root, ``precision`` (``--precision``) its runs' floating
    type (refused when the file varies it by run). Run directories are made absolute (Ray workers)."""
    path = Path(path)
    raw = _load_grid_file(path)
    if precision is not None:
        raw = with_precision(raw, precision, str(path))
    root = Path(out or raw.get("out") or Path("runs") / path.stem).resolve()
    fixed = raw.get("fixed") or {}
    data_dir = fixed.get("data_dir", fixed.get("data-dir"))
    if isinstance(fixed, dict) and data_dir and not Path(str(data_dir)).expanduser().is_absolute():
        fixed = {k: v for k, v in fixed.items() if k not in ("data_dir", "data-dir")}
        fixed["data_dir"] = str((path.parent / str(data_dir)).expanduser().resolve())
        raw = dict(raw, fixed=fixed)
    return SweepGrid(root=root, tasks=expand_grid(raw, root=root, source=str(path)))


def with_precision(raw: dict, precision: str, source: str) -> dict:
    """A parsed grid with every run's ``precision`` set in its [fixed] table; a ConfigError line when [grid] or an
    [[include]] sets it per run (the runs would then share folders)."""
    from .utils.precision import check_precision

    check_precision(precision)
    per_run = [raw.get("grid")] + list(raw.get("include") or [])
    if any(isinstance(t, dict) and {"precision"} & {str(k).replace("-", "_") for k in t} for t in per_run):
        raise ConfigError(f"--precision {precision}: {source} sets the precision per run ([grid] or [[include]]); "
                          "drop one of the two")
    fixed = raw.get("fixed") if isinstance(raw.get("fixed"), dict) else {}
    return dict(raw, fixed=dict(fixed, precision=precision))


def run_sweep(grid_file: str | Path, *, executor=None, out: str | Path | None = None, threads: int | None = None,
              dry_run: bool = False, echo: Callable[[str], None] | None = None,
              precision: str | None = None) -> list[dict]:
    """Run every run of ``grid_file`` (skipping finished work, resuming unfinished runs) and write
    ``sweep.csv`` (one line per run: what was done, seconds, error) in the sweep's root. ``precision``: every
    run's floating type (``--precision``), instead of the file's."""
    from .executors import LocalExecutor, default_threads
    from .utils.threads import check_threads

    check_threads(threads)
    grid = read_grid(grid_file, out=out, precision=precision)
    executor = executor or LocalExecutor(1)
    per_task = threads or (default_threads(getattr(executor, "workers", 1)) if executor.name == "local" else
                           max(1, int(getattr(executor, "cpus_per_task", 1))))
    for t in grid.tasks:
        t.threads = t.threads or per_task
    if dry_run:
        from .train.config import build_config

        rows = []
        for t in grid.tasks:
            state = run_state(t.run_dir, expected=build_config({}, dict(t.settings, out=t.run_dir)))
            rows.append({"name": t.name, "run_dir": t.run_dir, "state": state})
            if echo:
                echo(f"{state:>8}  {t.name}")
        return rows
    from .utils.lock import folder_lock

    from .utils.manifest import refuse_foreign

    with folder_lock(grid.root):  # one sweep at a time writes sweep.csv (each run folder has its own lock)
        refuse_foreign(grid.root, ["sweep.csv"])  # a file of the user's of that name: before any run trains
        records = run_tasks(grid.tasks, executor, echo=echo)
        _write_index(grid.root / "sweep.csv", records)
    return records


def _write_index(path: Path, records: Iterable[dict]) -> None:
    import csv
    import io

    from .utils.csv_cells import csv_row
    from .utils.io import atomic_write_text

    cols = ["name", "run_dir", "train", "hessian", "clients", "spectrum", "surface", "seconds", "error"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in records:
        w.writerow(csv_row(r))
    atomic_write_text(path, buf.getvalue())

