"""The report's metrics, one registry: each :class:`ReportMetric` says what a table column is called, how its value,
its estimator's own error and the settings that made it are read from a run, under which names the papers' values
of it stand in ``paper_values.csv``, and how the forest plot reads its direction. A table (``TableSpec.metrics``)
names its metrics; the table builder, the direction checks, the CSV, Markdown and PDF renderers and ``flatfl
contrast`` ask this registry and never compare metric names.

Another package adds a metric by calling :func:`register_metric` before the report is built (a table naming it then
gets its column, its direction checks and its CSV columns ``ours_<name>``, ``paper_<name>``, ...).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ConfigError, unknown_name
from .run_reader import MODEL_ACCURACY, MODEL_NAMES

__all__ = ["ReportMetric", "register_metric", "unregister_metric", "report_metric", "metric_names", "metric_title",
           "register_quantity_metrics", "metric_columns",
           "measured_metrics", "clients_needed",
           "eigen_precision", "trace_precision", "data_setting", "DEFAULT_SPLIT", "RUNS_CSV_PARTS"]

DEFAULT_SPLIT = "train"  # the split a Hessian is measured on unless --split says otherwise
_DEFAULT_LOSSES = (None, "cross_entropy")  # how hessian.json records the default loss (none given: cross-entropy)
#: what of a metric runs.csv may carry: its value (column ``<name>``), its error (``<name>_stderr``) and the settings
#: that made it (``<name>_setting``), enough to re-render the report's tables from runs.csv alone (:mod:`.runs_csv`)
RUNS_CSV_PARTS = ("value", "error", "setting")
_NAME = re.compile(r"[a-z][a-z0-9_]*")


def _nothing(record) -> None:
    return None


@dataclass(frozen=True)
class ReportMetric:
    """One metric of the report's tables.

    ``name``: the key tables name it by and the CSV columns are made of; ``label``: its name in the Markdown
    tables, the findings and the forest plot; ``short``: its PDF column head and settings-line label; ``unit``:
    shown after the label ('accuracy (%)'). ``value``, ``error`` and ``setting`` are functions of a run record
    (:class:`~flatfl.report.records.RunRecord`: its selected ``hessian``, ``clients`` and accuracy curve): the
    number (None: not measured), the estimator's own error of it (None: none given) and the settings that change
    the number as one short string (two runs whose strings differ are never averaged unmarked). ``paper_names``:
    the names of its published values in ``paper_values.csv``'s metric column (default: ``name``). ``reading``:
    how its direction reads in the forest plot ('lower: flatter'; '' for none). ``cross_client``: measured across
    clients (H_N / H_D): a table with it needs each run's clients' models and a ``flatfl hessian-clients`` result.
    ``settings_line``: whether a table's settings line names the settings of its column (the model is said once).
    ``runs_csv``: what runs.csv carries of it, of :data:`RUNS_CSV_PARTS`. ``when_measured``: not a fixed column of
    any table: a table (and runs.csv) gets its column where at least one of its runs measured it
    (:func:`~flatfl.report.layouts.with_measured_metrics`), as the smallest eigenvalue, which an analysis computes
    only when asked (``flatfl hessian --smallest``)."""

    name: str
    label: str
    short: str
    value: Callable[[Any], float | None]
    error: Callable[[Any], float | None] = _nothing
    setting: Callable[[Any], str | None] = _nothing
    unit: str = ""
    paper_names: tuple[str, ...] = ()
    reading: str = ""
    cross_client: bool = False
    settings_line: bool = True
    runs_csv: tuple[str, ...] = ()
    when_measured: bool = False

    @property
    def title(self) -> str:
        """The label with its unit: 'accuracy (%)', 'top eigenvalue'."""
        return f"{self.label} ({self.unit})" if self.unit else self.label


_REGISTRY: dict[str, ReportMetric] = {}


def register_metric(name: str, label: str, value: Callable, *, short: str = "", error: Callable | None = None,
                    setting: Callable | None = None, unit: str = "", paper_names=(), reading: str = "",
                    cross_client: bool = False, settings_line: bool = True, runs_csv=(), when_measured: bool = False,
                    replace: bool = False) -> ReportMetric:
    """Register a report metric (see :class:`ReportMetric` for the fields) and return its entry. ``short``
    defaults to the label, ``paper_names`` to the name. A name already taken is a ConfigError unless ``replace``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"a report metric's name must be lower-case letters, digits and '_' (a CSV column's "
                          f"part), starting with a letter; got {name!r}")
    for what, text in (("label", label), ("short", short), ("unit", unit), ("reading", reading)):
        if not isinstance(text, str) or (what == "label" and not text.strip()):
            raise ConfigError(f"report metric {name!r}: {what} must be {'a non-empty ' if what == 'label' else 'a '}"
                              f"string, got {text!r}")
    for what, fn in (("value", value), ("error", error), ("setting", setting)):
        if (fn is not None or what == "value") and not callable(fn):
            raise ConfigError(f"report metric {name!r}: {what} must be a function of a run record, got {fn!r}")
    names = (paper_names,) if isinstance(paper_names, str) else tuple(paper_names)
    if not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"report metric {name!r}: paper_names must be names of paper_values.csv's metric column, "
                          f"got {paper_names!r}")
    parts = (runs_csv,) if isinstance(runs_csv, str) else tuple(runs_csv)
    for part in parts:
        if part not in RUNS_CSV_PARTS:
            raise unknown_name("runs.csv part", part, RUNS_CSV_PARTS)
    if name in _REGISTRY and not replace:
        raise ConfigError(f"a report metric called {name!r} is already registered (pass replace=True to replace it)")
    entry = ReportMetric(name, label.strip(), short or label.strip(), value, error or _nothing, setting or _nothing,
                         unit=unit, paper_names=names or (name,), reading=reading, cross_client=bool(cross_client),
                         settings_line=bool(settings_line), runs_csv=parts, when_measured=bool(when_measured))
    _REGISTRY[name] = entry
    return entry


def unregister_metric(name: str) -> None:
    """Remove a registered metric (a no-op when there is none of that name)."""
    _REGISTRY.pop(name, None)


def report_metric(name: str) -> ReportMetric:
    """The registered metric ``name``; an unknown one is a ConfigError naming the known ones."""
    if name not in _REGISTRY:
        raise unknown_name("metric", name, list(_REGISTRY))
    return _REGISTRY[name]


def metric_names() -> tuple[str, ...]:
    """The registered metrics' names, in the order they were registered."""
    return tuple(_REGISTRY)


def metric_title(name: str) -> str:
    """The metric's label with its unit ('accuracy (%)'); a name not registered now (in a report folder written
    while it was) as it is."""
    return _REGISTRY[name].title if name in _REGISTRY else name


def metric_columns(name: str) -> tuple[str, ...]:
    """runs.csv's columns of the registered metric ``name``: those of its ``runs_csv`` parts, of ``name``,
    ``name_stderr`` and ``name_setting``."""
    parts = report_metric(name).runs_csv
    return tuple(c for part, c in _all_columns(name) if part in parts)


def _all_columns(name: str) -> tuple[tuple[str, str], ...]:
    """``(part, column)`` for every runs.csv column a metric called ``name`` may have."""
    return (("value", name), ("error", f"{name}_stderr"), ("setting", f"{name}_setting"))


def measured_metrics(records) -> tuple[str, ...]:
    """The metrics computed only when asked (``when_measured``) that at least one of ``records`` measured."""
    return tuple(n for n, m in _REGISTRY.items() if m.when_measured and any(r.value(n) is not None for r in records))


def clients_needed(spec) -> bool:
    """Whether a table (:class:`~flatfl.paper_tables.TableSpec`) has a cross-client column: its runs need H_N / H_D."""
    return any(report_metric(m).cross_client for m in spec.metrics)


# ---------------------------------------------------------------------------------------------- settings strings
def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def eigen_precision(settings: dict) -> str:
    """How precisely the eigenvalues were estimated, as their setting shows it after the method: the tolerance
    (' (tol 0.001)'); '' where a file of an older flatfl recorded none. A looser estimate is another setting: never
    averaged with tighter ones unmarked."""
    tol = settings.get("tol")
    return f" (tol {tol:g})" if _number(tol) else ""


def trace_precision(settings: dict) -> str:
    """How precisely the trace was estimated, as its setting shows it after the method: the budget of products and
    the relative stopping rule (' (<= 40 HVPs, rtol 0.02)'); '' for the exact trace and where a file of an older
    flatfl recorded none."""
    if settings.get("trace_method") == "exact":  # no products, no target: computed, not estimated
        return ""
    parts = []
    if _number(settings.get("trace_hvps")):
        parts.append(f"<= {settings['trace_hvps']:g} HVPs")
    if _number(settings.get("trace_rtol")):
        parts.append(f"rtol {settings['trace_rtol']:g}")
    return f" ({', '.join(parts)})" if parts else ""


def data_setting(settings: dict) -> str:
    """What of a Hessian's settings changes what it measures besides the model, method and sample count, as the
    end of a Hessian metric's setting: ', test split' (another split than :data:`DEFAULT_SPLIT`), ', train mode'
    (not the evaluation mode), ', loss M:F' (a loss of the user's), ', ggn curvature' (another matrix than the
    Hessian: rows of two curvatures are never averaged together), ', finite-difference products', ', damping 0.0005'
    (the curvature + 0.0005 I); '' for the defaults."""
    out = ""
    split = settings.get("split", DEFAULT_SPLIT)
    if split not in (None, DEFAULT_SPLIT):
        out += f", {split} split"
    if settings.get("mode") not in (None, "eval"):
        out += f", {settings['mode']} mode"
    if settings.get("loss") not in _DEFAULT_LOSSES:
        out += f", loss {settings['loss']}"
    if settings.get("curvature") not in (None, "hessian"):
        out += f", {settings['curvature']} curvature"
    if settings.get("products") == "finite-difference":
        out += ", finite-difference products"
    if _number(settings.get("damping")) and settings["damping"]:  # the curvature + damping * I: another matrix
        out += f", damping {settings['damping']:g}"
    which = settings.get("which")  # not the largest (power iteration's own is named by its method): marked
    if which not in (None, "largest") and not (which == "magnitude" and settings.get("method") == "power"):
        out += f", {which} eigenvalues"
    return out


# ---------------------------------------------------------------------------------------------- the built-in metrics
def _finite(v) -> float | None:
    return float(v) if _number(v) and math.isfinite(float(v)) else None


def _hessian_setting(method_key: str, precision: Callable[[dict], str]) -> Callable:
    """The setting of a metric of the run's Hessian analysis: 'all-clients average, lanczos (tol 0.001), 1437
    samples' (the model, the estimator and its precision, the samples, what differs from the defaults)."""
    def setting(rec) -> str | None:
        h = rec.hessian
        if not h:
            return None
        s = h.get("settings") or {}
        return (f"{MODEL_NAMES[rec.model]}, {s.get(method_key, '?')}{precision(s)}, "
                f"{h.get('num_samples', '?')} samples{data_setting(s)}")
    return setting


def _top_eigenvalue(rec) -> float | None:
    values = (rec.hessian or {}).get("top_eigenvalues") or []
    return float(values[0]) if values else None


def _first_error(fields: dict) -> float | None:
    """The first eigenvalue's error estimate of an analysis' ``fields`` (hessian.json, or its
    ``smallest_eigenvalues``), else its residual norm (a bound on the error)."""
    est, res = fields.get("error_estimates") or [], fields.get("residuals") or []
    return est[0] if est and est[0] is not None else (res[0] if res else None)


def _top_eigenvalue_error(rec) -> float | None:
    return _first_error(rec.hessian or {})


def _smallest(rec) -> dict:
    """hessian.json's ``smallest_eigenvalues`` (``flatfl hessian --smallest K``), {} where not computed."""
    low = (rec.hessian or {}).get("smallest_eigenvalues")
    return low if isinstance(low, dict) else {}


def _smallest_eigenvalue(rec) -> float | None:
    values = _smallest(rec).get("values") or []
    return _finite(values[0]) if values else None


def _smallest_setting(rec) -> str | None:
    """'all-clients average, lanczos (tol 0.001), 1442 samples' (its own method: power iteration cannot find it)."""
    low = _smallest(rec)
    if not low:
        return None
    h = rec.hessian
    s = h.get("settings") or {}
    beside = {k: v for k, v in s.items() if k != "which"}  # --which orders the top eigenvalues, not these
    return (f"{MODEL_NAMES[rec.model]}, {low.get('method', '?')}{eigen_precision(s)}, "
            f"{h.get('num_samples', '?')} samples{data_setting(beside)}")


def _trace(rec) -> float | None:
    tr = (rec.hessian or {}).get("trace") or {}
    return None if tr.get("estimate") is None else float(tr["estimate"])


def _eigenvalue_ratio(rec) -> float | None:
    """lambda_1 / lambda_5 as hessian.json records it (``eigenvalue_ratio``: written when at least five eigenvalues
    were computed); None for an analysis of fewer."""
    ratio = (rec.hessian or {}).get("eigenvalue_ratio")
    return _finite(ratio.get("value")) if isinstance(ratio, dict) and ratio.get("k") == 5 else None


def _clients_reader(key: str) -> Callable:
    def read(rec) -> float | None:
        v = (rec.clients or {}).get(key)
        return None if v is None else float(v)
    return read


def _clients_setting(rec) -> str | None:
    cl = rec.clients or {}
    if not cl:
        return None
    s = cl.get("settings") or {}
    return (f"protocol {cl.get('protocol', s.get('protocol', '?'))}, probes {s.get('probes', '?')}, "
            f"samples {s.get('samples') or 'all'}")


register_metric("accuracy", "accuracy", lambda rec: rec.accuracy(MODEL_ACCURACY[rec.model]), short="acc %",
                unit="%", setting=lambda rec: MODEL_NAMES[rec.model],
                paper_names=("accuracy", "accuracy_after_500_rounds"), reading="higher: better", settings_line=False)
register_metric("top_eigenvalue", "top eigenvalue", _top_eigenvalue, short="λmax", error=_top_eigenvalue_error,
                setting=_hessian_setting("method", eigen_precision), reading="lower: flatter",
                runs_csv=RUNS_CSV_PARTS)
register_metric("smallest_eigenvalue", "smallest eigenvalue", _smallest_eigenvalue, short="λmin",
                error=lambda rec: _first_error(_smallest(rec)), setting=_smallest_setting, runs_csv=RUNS_CSV_PARTS,
                when_measured=True)
register_metric("trace", "trace", _trace, error=lambda rec: ((rec.hessian or {}).get("trace") or {}).get("stderr"),
                setting=_hessian_setting("trace_method", trace_precision), reading="lower: flatter",
                runs_csv=RUNS_CSV_PARTS)
register_metric("hessian_norm_gap", "H_N", _clients_reader("H_N"), error=_clients_reader("H_N_stderr"),
                setting=_clients_setting, reading="lower: flatter", cross_client=True, runs_csv=RUNS_CSV_PARTS)
register_metric("hessian_direction", "H_D", _clients_reader("H_D"), error=_clients_reader("H_D_stderr"),
                setting=_clients_setting, cross_client=True, runs_csv=RUNS_CSV_PARTS)
register_metric("eigenvalue_ratio", "lambda_1/lambda_5", _eigenvalue_ratio, short="λ1/λ5",
                setting=_hessian_setting("method", eigen_precision), reading="lower: flatter",
                runs_csv=("value", "setting"))


# ---------------------------------------------------------------------------------------------- measured quantities
def _quantity_record(name: str) -> Callable:
    """The reader of hessian.json's ``quantities[name]`` ({} where the run did not measure it)."""
    def read(rec) -> dict:
        record = ((rec.hessian or {}).get("quantities") or {}).get(name)
        return record if isinstance(record, dict) else {}
    return read


def _quantity_setting(name: str) -> Callable:
    """'all-clients average, hutchinson on H^2 (<= 100 HVPs, rtol 0.01), 1442 samples' (the quantity's method and
    the trace's budget it ran within, the samples, what differs from the defaults)."""
    read = _quantity_record(name)

    def setting(rec) -> str | None:
        record = read(rec)
        if not record:
            return None
        h = rec.hessian
        s = {k: v for k, v in (h.get("settings") or {}).items() if k != "which"}  # --which orders eigenvalues only
        return (f"{MODEL_NAMES[rec.model]}, {record.get('method', name)}{trace_precision(s)}, "
                f"{h.get('num_samples', '?')} samples{data_setting(s)}")
    return setting




def register_quantity_metrics(reserved=()) -> tuple[str, ...]:
    """A report metric for each registered quantity (:mod:`flatfl.analysis.estimators.quantities`) not yet one: its
    title, short title and reading, a column where runs measured it (``when_measured``) and runs.csv's three
    columns. It is called by the quantity's name, or ``quantity_<name>`` where that name's columns are taken
    (``reserved``: runs.csv's own columns; or another metric's), so that it never replaces another value. Returns
    the metrics' names registered now."""
    from ..analysis.estimators.quantities import quantity, quantity_names

    added = []
    for name in quantity_names():
        if any(_QUANTITY_OF.get(n) == name for n in _REGISTRY):
            continue  # its metric exists
        taken = set(reserved).union(*(metric_columns(n) for n in _REGISTRY))
        key = name if not {c for _, c in _all_columns(name)} & taken else f"quantity_{name}"
        if {c for _, c in _all_columns(key)} & taken:
            continue  # pragma: no cover - a metric called quantity_<name> of someone else's
        entry, read = quantity(name), _quantity_record(name)
        register_metric(key, entry.title, lambda rec, read=read: _finite(read(rec).get("estimate")),
                        short=entry.short, error=lambda rec, read=read: _finite(read(rec).get("stderr")),
                        setting=_quantity_setting(name), reading=entry.reading, runs_csv=RUNS_CSV_PARTS,
                        when_measured=True)
        _QUANTITY_OF[key] = name
        added.append(key)
    return tuple(added)


#: report metric -> the quantity it shows (:func:`register_quantity_metrics`)
_QUANTITY_OF: dict[str, str] = {}
