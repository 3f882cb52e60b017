"""What makes two runs the same experiment: the one list of the run settings that change no number.

A run's settings (``RunConfig``'s fields, as config.json records them) fall in three groups:

* :data:`WHERE_IT_RAN`: where and how fast the run ran and where it wrote (device, threads, clients trained at once,
  CUDA graphs, the data folder). They may change between a run's start and its resumption, and between two seeds
  of one experiment.
* :data:`WHAT_IT_RECORDS`: what the run records beside its weights (how often it evaluates and checkpoints, the
  client models it saves, the curvature it tracks on the side, its log). They change no weight, so two runs that
  differ only in them are seeds of one experiment; a resumed run keeps them, so that its files do not mix two
  schedules.
* everything else decides the numbers, with the seed.

Every reader asks this module: resumption (``flatfl.train``), sweeps (an existing run folder is the asked run),
provenance digests (:mod:`flatfl.utils.provenance`) and reports (a row's runs are seeds of one experiment). The
parts that need the training registries (defaults, the hyper-parameters each piece reads) are in
:mod:`flatfl.train.identity`.
"""
from __future__ import annotations

from typing import Iterable, Mapping

__all__ = ["WHERE_IT_RAN", "WHAT_IT_RECORDS", "NO_NUMBER_SETTINGS", "RESUMABLE_CHANGES", "without_settings",
           "differing_keys"]

WHERE_IT_RAN = ("out", "device", "data_dir", "download", "threads", "eval_batch_size", "parallel_clients",
                "cuda_graphs")
WHAT_IT_RECORDS = ("eval_every", "checkpoint_every", "save_clients", "quiet", "track_hessian",
                   "track_hessian_settings")
#: settings that change no number: runs differing only in these are seeds of one experiment (the differences are
#: shown, not split)
NO_NUMBER_SETTINGS = WHERE_IT_RAN + WHAT_IT_RECORDS
#: settings that may change between a run's start and its resumption
RESUMABLE_CHANGES = WHERE_IT_RAN


def without_settings(config: Mapping | None, drop: Iterable[str]) -> dict:
    """``config`` less the keys in ``drop``."""
    drop = set(drop)
    return {k: v for k, v in (config or {}).items() if k not in drop}


def differing_keys(a: Mapping, b: Mapping) -> list[str]:
    """The keys whose values differ between two settings dicts (one missing counts as differing), sorted."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
