"""Glue between the command line and the engine: build the config, pick the run directory, train or resume."""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from .config import build_config, read_config_file
from ..errors import ConfigError
from ..utils import ranks
from ..utils.lock import LOCK_NAME, folder_lock
from .setup import start_process
from .engine import Trainer
from .run_folder import read_run_config


def default_run_dir(cfg) -> Path:
    reg = "" if cfg.reg == "none" else f"-{cfg.reg}"
    opt = "" if cfg.local_opt == "sgd" else f"-{cfg.local_opt}"
    part = cfg.partition if cfg.partition == "iid" else f"{cfg.partition}{cfg.alpha:g}"
    return Path("runs") / f"{cfg.dataset}-{cfg.algo}{opt}{reg}-{part}-s{cfg.seed}"


#: what --resume accepts beside it: how fast it runs, one of the settings a resumption may change
#: (:data:`flatfl.utils.run_identity.RESUMABLE_CHANGES`); every other setting is the run's, in its config.json
RESUME_FLAGS = ("threads",)


def train_from_options(*, config_file=None, resume_dir=None, force=False, quiet=False, opts=None,
                       observer_for=None) -> Path:
    """``observer_for(cfg)``: the run's observer (see :class:`~flatfl.train.engine.Trainer`) or None; the command
    line passes :func:`flatfl.analysis.commands.tracking.curvature_observer`."""
    opts = dict(opts or {})
    observer_for = observer_for or (lambda cfg: None)
    if resume_dir is not None:
        given = sorted(f"--{k.replace('_', '-')}" for k, v in opts.items() if v is not None and k not in RESUME_FLAGS)
        given = (["--config"] if config_file else []) + (["--force"] if force else []) + given
        if given:
            raise ConfigError(f"--resume continues {resume_dir} with the settings it started with; {', '.join(given)} "
                              "would be ignored: leave them out (or start a new run with another --out)")
        cfg = read_run_config(resume_dir)
        observer = observer_for(cfg)  # checks the run's tracking settings before the folder is locked
        # the device and threads once, for the Trainer too: --threads given here wins over the run's recorded count
        process = start_process(cfg.device, opts.get("threads") if opts.get("threads") is not None else cfg.threads)
        with _resume_hint(Path(resume_dir)), folder_lock(resume_dir):
            trainer = Trainer(cfg, resume_dir, resume=True, quiet=quiet, observer=observer, process=process)
            return trainer.run()
    from .catalog import all_hparams

    hp_keys = set(all_hparams())
    cli = {k: v for k, v in opts.items() if k not in hp_keys and v is not None}
    params = {k: v for k, v in opts.items() if k in hp_keys and v is not None}
    if params:
        cli["params"] = params
    file_settings = read_config_file(config_file) if config_file else {}
    cfg = build_config(file_settings, cli)
    observer = observer_for(cfg)  # the tracking settings checked by the analysis that computes them, before any folder
    # the device and threads once, before any folder is made or data read; under torchrun the ranks meet here
    process = start_process(cfg.device, cfg.threads)
    run_dir = Path(cfg.out) if cfg.out else default_run_dir(cfg)
    cfg.out = str(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--out {run_dir} exists and is not a directory")
    with folder_lock(run_dir):  # rank 0's alone, which checks (and with --force empties) the folder
        ranks.on_main(lambda: _fresh_run_dir(run_dir, force))
        with _resume_hint(run_dir):
            return Trainer(cfg, run_dir, quiet=quiet, observer=observer, process=process).run()


def _fresh_run_dir(run_dir: Path, force: bool) -> None:
    """A new run's folder holds nothing but its lock, and what a run stopped before its first file leaves (its
    manifest, a temporary) (``force``: a flatfl run's files are deleted first)."""
    from ..utils.atomic import TEMPORARY_NAME
    from ..utils.manifest import MANIFEST

    if any(p.name not in (LOCK_NAME, MANIFEST) and not TEMPORARY_NAME.match(p.name) for p in run_dir.iterdir()):
        if not force:
            raise ConfigError(f"run directory {run_dir} already exists: use --resume {run_dir} to continue it, "
                              "--force to overwrite it, or another --out")
        _clear_run_dir(run_dir)


@contextlib.contextmanager
def _resume_hint(run_dir: Path):
    """Ctrl-C while ``run_dir`` trains: the KeyboardInterrupt carries, as ``hint``, what was kept and the command
    that continues (the command line prints it, :func:`flatfl.cli.common.interrupted_line`)."""
    try:
        yield
    except KeyboardInterrupt as e:
        if (run_dir / "config.json").is_file():
            e.hint = f"the run is kept up to its last checkpoint: flatfl train --resume {run_dir} continues it"
        else:
            e.hint = "the run had not started; run the same command again"
        raise


def _clear_run_dir(run_dir: Path) -> None:
    """--force: empty a flatfl run folder; refuse (deleting nothing) if it is not one or holds files of the user's."""
    from ..utils.manifest import foreign_files, is_flatfl_run

    if not is_flatfl_run(run_dir):
        raise ConfigError(f"--force: {run_dir} is not a flatfl run directory (no flatfl config.json); "
                          "refusing to delete it")
    import contextlib
    import os

    foreign = foreign_files(run_dir, legacy_run=True)
    if foreign:
        raise ConfigError(f"--force: {run_dir} holds {len(foreign)} file(s) flatfl did not write "
                          f"(e.g. {foreign[0].relative_to(run_dir)}); refusing to delete it")
    with contextlib.ExitStack() as held:
        # a sub-folder another flatfl process is writing (hessian --out RUN/hessian) is never deleted under it:
        # its lock is taken here for the deletion, and a held one refuses (nothing deleted)
        for root, dirs, files in os.walk(run_dir):
            dirs[:] = [d for d in dirs if not (Path(root) / d).is_symlink()]
            if Path(root) != run_dir and LOCK_NAME in files:
                try:
                    held.enter_context(folder_lock(root))
                except ConfigError as e:
                    raise ConfigError(f"--force: {e}; refusing to delete {run_dir}") from None
        for p in run_dir.iterdir():
            if p.name == LOCK_NAME:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()


def describe_partition(dataset, data_dir, method, alpha, clients, seed, run_dir=None) -> str:
    import json

    import numpy as np

    from ..data import load_dataset
    from ..data.partition import Partition, format_histogram, make_partition

    if run_dir is not None:
        f = Path(run_dir) / "partition.json"
        if not f.is_file():
            raise ConfigError(f"{run_dir} has no partition.json: not a flatfl run")
        cfg = read_run_config(run_dir)
        ds = load_dataset(cfg.dataset, cfg.data_dir, download=False)
        try:
            part = Partition.from_dict(json.loads(f.read_text(encoding="utf-8")))
        except Exception:
            raise ConfigError(f"{f} is corrupt: not a flatfl partition") from None
    else:
        ds = load_dataset(dataset, data_dir)
        part = make_partition(ds.train_y.numpy(), clients, method, alpha, seed)
    labels = ds.train_y.numpy()
    counts = part.label_counts(labels, ds.num_classes)
    frac = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    head = (f"{part.method} partition of {ds.name} (alpha={part.alpha}, seed={part.seed}): {part.num_clients} clients, "
            f"sizes {int(part.sizes.min())}-{int(part.sizes.max())}, mean max-class share {frac.max(1).mean():.3f}")
    return head + "\n" + format_histogram(part, labels, ds.num_classes)
