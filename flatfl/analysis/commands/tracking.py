"""Curvature during training (``flatfl train --track-hessian K``): the observer the training engine calls.

Every K rounds and at the last, on the server model of that round, exactly what ``flatfl hessian`` computes on a
checkpoint with the same settings (:func:`flatfl.analysis.commands.hessian_settings.tracking_settings`): the model is rebuilt
from the round's checkpoint payload (the bytes ``final.pt`` holds at the last round), the evaluation batches are
:meth:`flatfl.checkpoint.Checkpoint.eval_batches` of the same split, sample and seed, and the estimators run through
:func:`flatfl.analysis.commands.hessian_command.compute`. So the last row of ``metrics.csv`` equals ``flatfl hessian final.pt``
with those settings. The engine (``flatfl.train``) never imports this module: the command line hands the observer
in (:func:`curvature_observer`).

Columns: ``hessian_top`` (largest algebraic eigenvalue with Lanczos, largest in magnitude with power iteration),
``hessian_eig2`` .. ``hessian_eig<k>`` with ``top = k``, ``hessian_trace`` and ``hessian_trace_se``,
``hessian_trace_target`` (the relative standard error the trace stops at) and ``hessian_trace_budget`` (the most
products it may spend), ``hessian_<name>`` and ``hessian_<name>_se`` for each measured quantity (``--track-measure``,
:mod:`flatfl.analysis.estimators.quantities`), ``hessian_loss`` (training loss of the server model on the evaluation set, eval mode),
``hessian_all_loss`` (the same for the average of all clients' latest models), ``hessian_hvps``, ``hessian_status``;
and ``observer_seconds`` (cumulative seconds spent here, written by the engine).

``hessian_status``: ``ok``; ``unresolved`` when the trace's standard error, or a measured quantity's, is still above
its target times the value at the budget (the point is circled, with its interval, in the report: the value is not
known to the target); ``failed`` when the analysis of that round failed (e.g. non-finite weights after a divergent step):
one line names it, the curvature columns stay blank and training goes on.

The settings are checked against the network before the first round (:meth:`CurvatureTracker.check_model`), so
an impossible one (more eigenvalues than parameters) stops the run before anything is trained or written.
"""
from __future__ import annotations

import dataclasses
import math
import re
import sys
from pathlib import Path

from ...checkpoint import FINAL_FILE, Checkpoint
from ...errors import ConfigError
from .hessian_settings import TRACKING_FIELDS, HessianSettings, tracking_settings
from .hessian_command import compute
from ..estimators.quantities import measure_record, quantity
from ..operators.curvatures import curvature_operator
from ..operators.distributed import over_ranks
from ..operators.hessian import HessianOperator

__all__ = ["CurvatureTracker", "curvature_observer", "tracking_columns", "quantity_columns", "own_column",
           "trace_resolved"]


TRACE_COLUMNS = ("hessian_trace", "hessian_trace_se", "hessian_trace_target", "hessian_trace_budget")
ROUND_COLUMNS = ("hessian_loss", "hessian_all_loss", "hessian_hvps", "hessian_status")


def own_column(column: str) -> bool:
    """Whether ``column`` is one of curvature tracking's own (the eigenvalues', the trace's, the round's), which no
    measured quantity's column may be, with whatever settings: a reader could not tell them apart."""
    fixed = ("hessian_top", *TRACE_COLUMNS, *ROUND_COLUMNS)
    return column in fixed or re.fullmatch(r"hessian_eig\d+", column) is not None


def quantity_columns(name: str) -> list[str]:
    """A tracked quantity's metrics.csv columns: its estimate and its standard error."""
    return [f"hessian_{name}", f"hessian_{name}_se"]


def tracking_columns(settings: HessianSettings) -> list[str]:
    """The metrics.csv columns of curvature tracking with these settings; a quantity whose column is tracking's own
    or another quantity's is one ConfigError line."""
    cols = []
    if settings.top:
        cols += ["hessian_top"] + [f"hessian_eig{i}" for i in range(2, settings.top + 1)]
    if settings.trace:
        cols += list(TRACE_COLUMNS)
    for name in settings.quantities:  # each measured quantity (--track-measure): its estimate and standard error
        for column in quantity_columns(name):
            if own_column(column) or column in cols:
                raise ConfigError(f"--track-measure {name}: the quantity's metrics.csv column {column} is "
                                  f"{'curvature tracking' if own_column(column) else 'another quantity'}'s own; "
                                  "it can be measured by flatfl hessian --measure, not tracked")
        cols += quantity_columns(name)
    return cols + list(ROUND_COLUMNS)


def trace_resolved(trace: float, stderr: float, target: float | None) -> bool:
    """Whether a trace estimate meets its target: ``stderr <= target * |trace|`` (no target: always)."""
    if target is None:
        return True
    return math.isfinite(trace) and math.isfinite(stderr) and stderr <= target * abs(trace)


class CurvatureTracker:
    """Computes the curvature columns of a round from its checkpoint payload (see the module docstring)."""

    name = "curvature tracking"

    def __init__(self, every: int, settings: HessianSettings, log=None) -> None:
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.every = int(every)
        self.hessian = settings
        self.columns = tracking_columns(settings)
        self.settings = {"every": self.every, **self.hessian_settings()}
        self._batches = None

    def hessian_settings(self) -> dict:
        """The fields of ``flatfl hessian``'s settings (run_hessian's HessianSettings) that give the same numbers on a
        checkpoint (the curvature only when it is not the Hessian, the measured quantities only when there are: the
        record of a tracking without them is what it always was)."""
        record = {name: getattr(self.hessian, name) for name in TRACKING_FIELDS}
        record["measure"] = measure_record(self.hessian.measure)
        for name, default in (("curvature", "hessian"), ("measure", None)):
            if record[name] == default:
                del record[name]
        return record

    def wants(self, rnd: int, rounds: int) -> bool:
        return rnd % self.every == 0 or rnd == rounds

    def check_model(self, model) -> None:
        """The settings against the network to be trained, before the first round: ConfigError naming the option."""
        dim = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if self.hessian.top > dim:
            raise ConfigError(f"--track-top {self.hessian.top} is larger than the number of parameters of the model "
                              f"({dim})")
        for name in self.hessian.quantities:  # one that can spend no product with these settings would fail each round
            if quantity(name).bound(self.hessian, dim) < 1:
                raise ConfigError(f"--track-measure {name}: the quantity spends no product with these settings "
                                  f"(trace_hvps {self.hessian.trace_hvps}); give it a larger budget")

    def __call__(self, payload: dict, run_dir) -> dict:
        """The row of a tracked round; a failure is one line and a ``failed`` row (training goes on)."""
        try:
            row = self._measure(payload, run_dir)
        except Exception as e:  # noqa: BLE001 - any failure of the analysis is reported, not fatal to training
            row = {}
            reason = " ".join(str(e).split()) or type(e).__name__
            self.log(f"curvature tracking failed at round {payload.get('round', '?')}: {reason[:300]}; the point is "
                     "marked failed in metrics.csv and training goes on")
        else:
            values = [v for k, v in row.items() if k.startswith("hessian_") and isinstance(v, float)]
            if all(math.isfinite(v) for v in values):
                return row
            self.log(f"curvature tracking failed at round {payload.get('round', '?')}: non-finite values (the "
                     "weights or the loss are not finite); the point is marked failed in metrics.csv and training "
                     "goes on")
        return {"hessian_status": "failed"}

    def _measure(self, payload: dict, run_dir) -> dict:
        s = self.hessian
        path = Path(run_dir) / FINAL_FILE  # where a custom dataset's data.pt is looked for
        ckpt = Checkpoint(payload, path, device=s.device)
        if self._batches is None:  # the same fixed evaluation set every time
            self._batches = ckpt.eval_batches(split=s.split, samples=s.samples, batch_size=s.batch_size, seed=s.seed)
        # under torchrun (training over ranks): this rank's shard of the evaluation set, products all-reduced
        op = over_ranks(lambda shard: curvature_operator(s.curvature, ckpt.model, shard, mode="eval",
                                                         products=s.products), self._batches)
        report, _, _ = compute(op, dataclasses.replace(s, density=False))
        row = {"hessian_loss": op.loss(), "hessian_hvps": report["hvps_total"]}
        op.release()
        for i, value in enumerate(report["top_eigenvalues"], 1):
            row["hessian_top" if i == 1 else f"hessian_eig{i}"] = float(value)
        row["hessian_status"] = "ok"
        if report["trace"] is not None:
            row["hessian_trace"] = float(report["trace"]["estimate"])
            row["hessian_trace_se"] = float(report["trace"]["stderr"])
            row["hessian_trace_target"] = s.trace_rtol
            row["hessian_trace_budget"] = s.trace_hvps
            if not trace_resolved(row["hessian_trace"], row["hessian_trace_se"], s.trace_rtol):
                row["hessian_status"] = "unresolved"
        for name, record in (report.get("quantities") or {}).items():
            value, se = quantity_columns(name)
            row[value] = float(record["estimate"])
            row[se] = None if record.get("stderr") is None else float(record["stderr"])  # blank
            if record.get("target_reached") is False:  # stopped by its budget above its target, as a trace can be
                row["hessian_status"] = "unresolved"
        average_model = Checkpoint(payload, path, device=s.device, which="all").model
        average = over_ranks(lambda shard: HessianOperator(average_model, shard, mode="eval"), self._batches)
        row["hessian_all_loss"] = average.loss()
        average.release()
        return row


def curvature_observer(cfg) -> CurvatureTracker | None:
    """The observer of a run config (``cfg.track_hessian``: every K rounds, 0: none), on the run's device."""
    if not getattr(cfg, "track_hessian", 0):
        return None
    return CurvatureTracker(cfg.track_hessian, tracking_settings(cfg.track_hessian_settings, device=cfg.device))
