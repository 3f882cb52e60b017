"""A run's files: what a run directory holds and how each file is written and read back.

* ``config.json``: the resolved config, the network's spec, the pieces' hyper-parameters, the data's origin, the
  environment and the training path (:func:`write_run_record`); read back by :func:`read_run_config` (``--resume``)
  and :func:`saved_run_info`.
* ``partition.json`` and, for a custom dataset, ``data.pt`` (:func:`save_run_data`, :func:`saved_partition`).
* ``metrics.csv`` (:func:`write_metrics`).
* ``checkpoints/round_XXXX.pt``, ``clients.pt``, ``final.pt``, ``final-clients-average.pt`` and ``resume.pt``
  (:func:`save_round`); the resume state is read back, checked against the run's settings, by
  :func:`load_resume`.
* a ``final.pt`` lost between the last ``resume.pt`` and ``final.pt``: :func:`recover_final`.

Every file is written atomically (:mod:`flatfl.utils.io`).
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Callable, Iterable

from ..checkpoint import CUSTOM_DATA_FILE, FINAL_FILE, dataset_sha256, save_checkpoint, save_clients_average
from ..data.partition import Partition
from ..errors import ConfigError
from ..utils.csv_cells import csv_row
from ..utils.io import atomic_torch_save, atomic_write_bytes, atomic_write_json, atomic_write_text
from ..utils.run_identity import differing_keys
from .config import RunConfig
from .identity import run_settings
from .resume import load_resume_state, save_resume_state

__all__ = ["METRIC_COLUMNS", "CONFIG_FILE", "PARTITION_FILE", "RESUME_FILE", "CLIENTS_FILE", "CUSTOM_DATA_FILE",
           "CUSTOM_DATA_LIMIT_BYTES", "round_checkpoint", "saved_run_info", "saved_factory", "saved_partition",
           "read_run_config", "dataset_info", "write_run_record", "update_training_path", "save_run_data",
           "write_metrics", "save_round",
           "last_good_checkpoint", "load_resume", "recover_final"]

METRIC_COLUMNS = ["round", "lr", "clients", "local_loss", "train_loss", "train_acc", "test_loss", "test_acc",
                  "all_test_loss", "all_test_acc", "seconds"]
CONFIG_FILE = "config.json"
PARTITION_FILE = "partition.json"
RESUME_FILE = "resume.pt"
CLIENTS_FILE = "clients.pt"  # each client's latest local model (--save-clients)
CUSTOM_DATA_LIMIT_BYTES = 1 << 30


def round_checkpoint(run_dir: str | Path, rnd: int) -> Path:
    """The checkpoint of round ``rnd`` (1-based): ``checkpoints/round_XXXX.pt``."""
    return Path(run_dir) / "checkpoints" / f"round_{rnd:04d}.pt"


# ----------------------------------------------------------------------------------------------- reading back
def saved_run_info(run_dir: str | Path) -> dict:
    """The run's config.json as recorded; {} when it is missing or unreadable."""
    try:
        info = json.loads((Path(run_dir) / CONFIG_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return info if isinstance(info, dict) else {}


def saved_factory(run_dir: str | Path) -> str | None:
    """The model factory a custom-model run recorded (resuming it without a model); an error when it has none."""
    spec = saved_run_info(run_dir).get("model") or {}
    if spec.get("name") != "custom":
        return None
    if not spec.get("factory"):
        raise ConfigError(f"{run_dir} was trained on a custom network ({spec.get('class', '?')}) with no model "
                          "factory recorded: resume it from Python, Trainer(cfg, run_dir, resume=True, model=net)")
    return spec["factory"]


def saved_partition(run_dir: str | Path) -> Partition | None:
    """The partition a run recorded (partition.json); None when it has none."""
    f = Path(run_dir) / PARTITION_FILE
    if not f.is_file():
        return None
    try:
        return Partition.from_dict(json.loads(f.read_text(encoding="utf-8")))
    except Exception:
        raise ConfigError(f"--resume: {f} is corrupt; restore it or start a new run") from None


def read_run_config(run_dir: str | Path) -> RunConfig:
    """The config of an existing run directory (for --resume)."""
    d = Path(run_dir)
    f = d / CONFIG_FILE
    if not d.is_dir():
        raise ConfigError(f"--resume: {d} is not a directory")
    if not f.is_file():
        raise ConfigError(f"--resume: {d} is not a flatfl run (no config.json)")
    try:
        raw = json.loads(f.read_text(encoding="utf-8"))
        cfg = RunConfig.from_dict(raw["config"])
    except Exception:
        raise ConfigError(f"--resume: {f} is corrupt") from None
    return cfg.validate()


# ----------------------------------------------------------------------------------------------- writing
def dataset_info(ds, custom: bool, digest: bool = True) -> dict:
    """Where the run's data comes from: a dataset name, or (custom data) the run's data.pt when saved (up to
    :data:`CUSTOM_DATA_LIMIT_BYTES`), with the data's ``sha256`` (:func:`flatfl.checkpoint.own_data_sha256`;
    ``digest=False``: not computed), saved or not. It ties data.pt to its run (readers refuse another run's,
    :func:`flatfl.checkpoint.load_run_data`), data given to a resumed run to the data it trained on, and tells the
    report which runs trained on the same data."""
    info = {"name": ds.name, "custom": custom, "file": None}
    if custom:
        size = sum(t.numel() * t.element_size() for t in (ds.train_x, ds.train_y, ds.test_x, ds.test_y))
        info["file"] = CUSTOM_DATA_FILE if size <= CUSTOM_DATA_LIMIT_BYTES else None
        if digest:
            info["sha256"] = dataset_sha256(ds)
    return info


def write_run_record(run_dir: Path, record: dict, *, start_round: int) -> None:
    """config.json: ``record``, the run as it starts now (its ``environment`` and ``training_path`` this
    process's). A resumed run (``start_round`` > 0) keeps the versions its earlier rounds were trained with; each
    resumption is added to ``resumed``."""
    record = dict(record)
    environment, training_path = record["environment"], record["training_path"]
    earlier = saved_run_info(run_dir) if start_round > 0 else {}
    if isinstance(earlier.get("environment"), dict):
        resumed = earlier.get("resumed") if isinstance(earlier.get("resumed"), list) else []
        record.update(flatfl_version=earlier.get("flatfl_version", record.get("flatfl_version")),
                      environment=earlier["environment"], training_path=earlier.get("training_path"),
                      resumed=resumed + [{"from_round": start_round, "environment": environment,
                                          "training_path": training_path}])
    atomic_write_json(run_dir / CONFIG_FILE, record)


def update_training_path(run_dir: Path, training_path: dict, *, start_round: int, from_round: int) -> None:
    """config.json's ``training_path`` of this process (the last ``resumed`` entry of a resumed run) replaced by
    ``training_path``, how the run trains from round ``from_round`` on (clients no longer trained together: a
    model that cannot be stacked, a cohort that did not fit in memory); ``changed_from_round`` says since when."""
    record = saved_run_info(run_dir)
    if not record:
        return
    path = dict(training_path, changed_from_round=from_round)
    resumed = record.get("resumed")
    if start_round > 0 and isinstance(resumed, list) and resumed and isinstance(resumed[-1], dict):
        resumed[-1] = dict(resumed[-1], training_path=path)
    else:
        record["training_path"] = path
    atomic_write_json(run_dir / CONFIG_FILE, record)


def save_run_data(run_dir: Path, ds, custom: bool, partition: Partition, label_counts,
                  log: Callable[[str], None]) -> None:
    """A custom dataset's data.pt (up to :data:`CUSTOM_DATA_LIMIT_BYTES`) and partition.json, unless there (a
    resumed run's data.pt was checked against its recorded digest when it was read: flatfl.train.setup)."""
    if custom and not (run_dir / CUSTOM_DATA_FILE).is_file():
        from ..data.datasets import dataset_payload

        if dataset_info(ds, custom, digest=False)["file"]:
            atomic_torch_save(dataset_payload(ds), run_dir / CUSTOM_DATA_FILE)
        else:
            log(f"the custom dataset is over {CUSTOM_DATA_LIMIT_BYTES >> 20} MiB and was not saved with "
                "the run: analyse it from Python (flatfl.analysis.HessianOperator(model, batches))")
    if not (run_dir / PARTITION_FILE).is_file():
        pd = partition.to_dict()
        pd["label_counts"] = label_counts.tolist()
        atomic_write_json(run_dir / PARTITION_FILE, pd)


def write_metrics(run_dir: Path, metrics: list[dict], extra: Iterable[str] = ()) -> None:
    """metrics.csv: :data:`METRIC_COLUMNS` at 6 significant digits, then the ``extra`` columns (an observer's,
    blank on rounds it skipped) in full precision."""
    extra = list(extra)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=METRIC_COLUMNS + extra, extrasaction="ignore")
    w.writeheader()
    for row in metrics:
        w.writerow(csv_row({k: (v if k in extra else f"{v:.6g}") if isinstance(v, float) else v
                            for k, v in row.items()}))
    atomic_write_text(run_dir / "metrics.csv", buf.getvalue())


def save_round(run_dir: Path, rnd: int, payload: dict, state: dict, *, final: bool,
               clients: dict | None = None) -> None:
    """Round ``rnd``'s files: its checkpoint (``payload``, :mod:`flatfl.checkpoint`), ``clients.pt`` when
    ``clients`` is given, on the last round (``final``) ``final-clients-average.pt`` and ``final.pt``, then
    ``resume.pt`` (``state``, :mod:`flatfl.train.resume`). final.pt comes first: a run whose resume.pt says finished always has its final.pt, or its last
    round's checkpoint (:func:`recover_final`)."""
    path = round_checkpoint(run_dir, rnd)
    path.parent.mkdir(exist_ok=True)
    save_checkpoint(path, payload)
    if clients is not None:
        atomic_torch_save(clients, run_dir / CLIENTS_FILE)
    if final:
        save_clients_average(run_dir, payload)  # the all-clients average, a checkpoint of its own
        save_checkpoint(run_dir / FINAL_FILE, payload)
    save_resume_state(run_dir / RESUME_FILE, state)


def last_good_checkpoint(run_dir: Path) -> str:
    """The newest round checkpoint, as a divergence message names it."""
    cks = sorted((run_dir / "checkpoints").glob("round_*.pt"))
    return str(cks[-1]) if cks else "none (no round completed a checkpoint)"


def load_resume(run_dir: Path, config: dict, dim: int) -> dict | None:
    """The run's resume state (:mod:`flatfl.train.resume`), None when the run was killed before its first
    checkpoint (it then starts from round 0: everything derives from the seed). Refused with one ConfigError line:
    a run whose settings (:func:`~flatfl.train.identity.run_settings` of ``config``) changed since it started, or
    whose model has other than ``dim`` parameters."""
    f = run_dir / RESUME_FILE
    if not f.is_file():
        return None
    st = load_resume_state(f)
    saved = st.get("settings")
    if isinstance(saved, dict):
        # a setting added after the run started: the run had it at its default (run_settings fills it in)
        now, saved = run_settings(config), run_settings(saved)
        changed = differing_keys(saved, now)
        if changed:
            shown = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed[:3])
            raise ConfigError(f"--resume: the settings of {run_dir} changed since the run started ({shown}); "
                              "restore config.json or start a new run with another --out")
    if st["theta"].numel() != dim:
        raise ConfigError(f"{f} does not match this run's model ({st['theta'].numel()} vs {dim} parameters)")
    return st


def recover_final(run_dir: str | Path, rnd: int, payload: Callable[[], dict] | None = None) -> bool:
    """A run killed between writing its last resume.pt (round ``rnd``, finished) and final.pt: final.pt is written
    now, as a copy of round ``rnd``'s checkpoint (the same payload), or, when that checkpoint is missing too, from
    ``payload()`` when given. True when final.pt was written; False when it was there or cannot be recovered."""
    run_dir = Path(run_dir)
    final = run_dir / FINAL_FILE
    if final.is_file():
        return False
    last = round_checkpoint(run_dir, rnd)
    if last.is_file():
        atomic_write_bytes(final, last.read_bytes())
        return True
    if payload is None:
        return False
    save_checkpoint(final, payload())
    return True
