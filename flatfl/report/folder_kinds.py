"""A report folder and a contrast folder told apart, so that neither is ever written over the other.

``flatfl report`` and ``flatfl contrast`` both write ``effects.png`` and ``effects.pdf`` (each its own forest plot),
and every file of both is flatfl's, so the manifest's ownership check alone would let one replace the other's. Each
folder's manifest therefore records its kind (:func:`flatfl.utils.manifest.record_kind`), and each command refuses a
folder of the other kind before any work (:func:`refuse_other`): one line, nothing written. A folder of an older
flatfl, which records no kind, is told by the files its manifest lists (:data:`SIGNS`). Neither is ever written into
a run's folder.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..utils.manifest import record_kind, refuse_other_kind

__all__ = ["REPORT", "CONTRAST", "SIGNS", "refuse_other", "record"]

REPORT, CONTRAST = "report", "contrast"
#: per kind, the files only that kind writes (how a folder of an older flatfl is told)
SIGNS = {REPORT: ("summary.json", "report.pdf", "report.md", "runs.csv"),
         CONTRAST: ("contrast.json", "contrast.md", "contrast.csv")}
#: what makes a folder a run's (flatfl.report.records.find_run_dirs reads runs by it too)
RUN_SIGN = "config.json"


def refuse_other(out, kind: str) -> None:
    """A ConfigError line when ``out`` holds flatfl's output of a kind other than ``kind`` (:data:`REPORT` or
    :data:`CONTRAST`), or a run (its ``config.json``: a run's folder is its own, and ``flatfl train --force``
    would clear whatever else it holds)."""
    out = Path(out)
    if (out / RUN_SIGN).is_file():
        raise ConfigError(f"{out} holds a flatfl run ({RUN_SIGN}): a {kind} is never written into a run's folder; "
                          "choose another --out")
    refuse_other_kind(out, kind, SIGNS)


def record(out, kind: str) -> None:
    """Record that ``out`` holds a ``kind`` (after its files are written: a folder whose writing failed part way is
    still told by its files, :data:`SIGNS`)."""
    record_kind(Path(out), kind)
