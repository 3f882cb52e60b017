"""The paper layouts the report fills (one :class:`~flatfl.paper_tables.TableSpec` per table, from
:mod:`flatfl.paper_tables`), the papers' published values (``paper_values.csv``, shipped with the package), which
runs a layout takes, the model its rows measure, and the scale lines that set our setting beside the paper's."""
from __future__ import annotations

import csv
from dataclasses import replace
from importlib import resources

from ..errors import unknown_name
from ..paper_tables import GROUPS, TABLES, TableSpec
from ..utils.machine import machine_label
from .metrics import measured_metrics, report_metric
from .run_reader import MODELS

__all__ = ["TABLE_ALIASES", "TABLES", "TableSpec", "paper_values", "paper_lookup", "fills", "records_of", "matching_tables", "tables_for", "model_for", "scale_label",
           "training_path_label", "paper_differences", "run_setting", "NOT_RECORDED", "NOT_COMPARED"]

TABLE_ALIASES = GROUPS


def paper_values() -> list[dict]:
    """The papers' published numbers (flatfl/report/paper_values.csv)."""
    text = resources.files("flatfl.report").joinpath("paper_values.csv").read_text(encoding="utf-8")
    rows = list(csv.DictReader(text.splitlines()))
    for r in rows:
        r["value"] = float(r["value"])
    return rows


def paper_lookup(spec: TableSpec, values: list[dict]) -> dict:
    """(paper method, partition, metric) -> value for ``spec``: the values of its own table (a paper's table:
    ``source`` and ``table``), and of its ``also_tables`` those of its rows and partitions; a value is read under
    each of its metric's ``paper_names`` (:mod:`.metrics`)."""
    names = {name: m for m in spec.metrics for name in report_metric(m).paper_names}
    rows = {spec.paper_name(row) for row in spec.rows}
    out = {}
    for r in values:
        metric, where = names.get(r["metric"]), (r["source"], r["table"])
        if metric is None:
            continue
        if (spec.source is not None and where == (spec.source, spec.table)) or (
                where in spec.also_tables and r["partition"] in spec.partitions and r["method"] in rows):
            out[(r["method"], r["partition"], metric)] = r["value"]
    return out


def fills(spec: TableSpec, record) -> bool:
    """Whether a run belongs in ``spec``'s layout: one of its methods on one of its partitions."""
    return record.method in spec.rows and record.partition in spec.partitions


def records_of(spec: TableSpec, records) -> list:
    """The runs of ``records`` that ``spec``'s layout takes, in their order."""
    return [r for r in records if fills(spec, r)]


def with_measured_metrics(spec: TableSpec, records) -> TableSpec:
    """``spec`` with a column for each metric computed only when asked (``when_measured``: the smallest
    eigenvalue) that at least one of its runs measured, after the top eigenvalue's (else last); ``spec`` itself when
    none did."""
    extra = tuple(n for n in measured_metrics(records_of(spec, records)) if n not in spec.metrics)
    if not extra:
        return spec
    at = spec.metrics.index("top_eigenvalue") + 1 if "top_eigenvalue" in spec.metrics else len(spec.metrics)
    return replace(spec, metrics=spec.metrics[:at] + extra + spec.metrics[at:])


def matching_tables(records) -> list[str]:
    """The layouts that at least one run fills (a run of one of its methods on one of its partitions); a layout
    that only gathers other tables' methods (``auto_match`` False: the SAM family) is made when it is named."""
    return [key for key, spec in TABLES.items() if spec.auto_match and any(fills(spec, r) for r in records)]


def tables_for(keys) -> list[TableSpec]:
    """Table specs by key, expanding 'man-tables'; a bad key is a ConfigError."""
    out = []
    for k in keys:
        for kk in TABLE_ALIASES.get(k, (k,)):
            if kk not in TABLES:
                raise unknown_name("table", k, list(TABLES) + list(TABLE_ALIASES))
            if TABLES[kk] not in out:
                out.append(TABLES[kk])
    return out


def model_for(spec: TableSpec, model: str | None) -> str:
    """The model whose numbers fill ``spec``'s rows: ``model`` when given, else the layout's default
    (``TableSpec.default_model``: the all-clients average for the MAN tables, the server model for FedAlign's;
    docs/reproductions.md)."""
    m = model or spec.default_model
    if m not in MODELS:
        raise unknown_name("model", m, MODELS)
    return m


#: a training setting a run's record does not hold (a runs.csv line records only a few: :mod:`.runs_csv`)
NOT_RECORDED = "not recorded"
#: how :func:`paper_differences` names the settings it cannot compare (read back by :mod:`.contrast`)
NOT_COMPARED = "not recorded, so not compared: "


def run_setting(record, key: str):
    """A run's training setting ``key``: its config.json's value; :data:`NOT_RECORDED` where the record holds only
    some settings (``recorded_settings``: a line of a runs.csv) and not this one."""
    recorded = getattr(record, "recorded_settings", None)
    if isinstance(recorded, dict):
        return recorded.get(key, NOT_RECORDED)
    return (getattr(record, "config", None) or {}).get(key)


def scale_label(records) -> str:
    """'ours: digits, digits-cnn, 20 clients, 50% participation (bernoulli), 50 rounds x 2 local epochs'."""
    if not records:
        return "ours: no runs"

    def one(key, fmt=str):
        vals = sorted({NOT_RECORDED if v is NOT_RECORDED else fmt(v) for v in (run_setting(r, key) for r in records)},
                      key=str)
        return vals[0] if len(vals) == 1 else "/".join(vals)

    from ..train.config import RunConfig

    models = sorted({getattr(r, "network_label", None) or RunConfig.from_dict(r.config).resolved_model()
                     + (f" {r.config['model_args']}" if r.config.get("model_args") else "") for r in records})
    model = "/".join(models)
    part = one("participation", lambda p: f"{100 * float(p):g}%")
    part = "participation not recorded" if part == NOT_RECORDED else f"{part} participation ({one('sampling')})"
    epochs = one("local_epochs")
    epochs = " (local epochs not recorded)" if epochs == NOT_RECORDED else f" x {epochs} local epochs"
    seeds = sorted({r.seed for r in records})
    datasets = sorted({r.dataset if str(r.dataset).startswith("custom") else str(run_setting(r, "dataset"))
                       for r in records}, key=str)
    return (f"ours: {'/'.join(datasets)}, {model}, {one('clients')} clients, {part}, {one('rounds')} rounds{epochs}, "
            f"{len(seeds)} seed(s); {_machines(records)}{training_path_label(records)}")


def _machines(records) -> str:
    """'machine CPU (capability), BLAS b, torch t; ' of the machines the runs trained on (config.json's
    ``environment``), '' where none is recorded."""
    label = machine_label(getattr(r, "machine", None) for r in records)
    return f"machine {label}; " if label else ""


def training_path_label(records) -> str:
    """Which computation trained the runs (config.json's ``training_path``): 'trained on cpu, one client at a time,
    float32 full' (', steps as CUDA graphs' when ``--cuda-graphs`` was on); several values joined by '/'; runs from
    before the record named as such."""
    paths = [r.training_path for r in records if r.training_path]
    if not paths:
        return "training path not recorded"

    def values(key, fmt=str):
        return "/".join(sorted({fmt(p.get(key, "?")) for p in paths}, key=str))

    def each(fmt):
        return "/".join(sorted({fmt(p) for p in paths}, key=str))

    def clients(path):
        k = path.get("clients_at_once", "?")
        text = "one client at a time" if k == 1 else f"{k} clients at once"
        since = path.get("changed_from_round")
        return text + (f" from round {since}" if isinstance(since, int) and not isinstance(since, bool) else "")

    devices = values("device", lambda d: str(d))
    names = sorted({str(p["device_name"]) for p in paths if p.get("device_name")})
    label = (f"trained on {devices}{' (' + '/'.join(names) + ')' if names else ''}, {each(clients)}, "
             f"{each(precision_text)}")
    ranks = sorted({(int(p["world_size"]), str(p.get("backend"))) for p in paths
                    if isinstance(p.get("world_size"), int) and not isinstance(p.get("world_size"), bool)
                    and p["world_size"] > 1})
    if ranks:  # a round's clients split over torchrun's ranks (the numbers are one process's)
        label += ", clients over " + "/".join(f"{n} ranks ({backend})" for n, backend in ranks)
    graphed = sum(1 for p in paths if p.get("cuda_graphs") is True)
    if graphed:
        label += ", steps as CUDA graphs" + ("" if graphed == len(paths) else f" in {graphed} of {len(paths)} runs")
    missing = len(records) - len(paths)
    return label + (f" ({missing} run(s) without a record)" if missing else "")


def precision_text(path: dict) -> str:
    """A training path's floating type as the scale line shows it: 'float64', or 'float32 full' / 'float32 tf32'
    (how its float32 products ran); a run recorded without a type ran in float32."""
    dtype = str(path.get("dtype") or "float32")
    return dtype if dtype != "float32" else f"float32 {path.get('float32_matmul', '?')}"


_BOOKKEEPING = ("eval_every", "checkpoint_every", "save_clients", "device", "seed")
_HESSIAN_COMPARED = ("method", "trace_method", "trace_hvps", "samples")


def _shown(values) -> str:
    """Our values of one setting as the scale line shows them: 'all' for None, several joined by '/'."""
    return "/".join(sorted({"all" if v is None else str(v) for v in values}, key=str))


def _run_differences(paper_run: dict, runs) -> list[str]:
    from ..train.config import RunConfig

    diffs = []
    for key, want in paper_run.items():
        if key in _BOOKKEEPING:
            continue
        if key == "model":  # a network of the user's by its record (config.json's model), else by the settings
            got = _shown(getattr(r, "network_label", None) or RunConfig.from_dict(r.config).resolved_model()
                         for r in runs)
            args = _shown(str(r.config.get("model_args") or "") for r in runs if not getattr(r, "network_label", None))
            if args:
                got += f" {args}"
        elif key == "dataset":  # data of the user's by its record, else by the settings
            got = _shown(r.dataset if str(getattr(r, "dataset", "")).startswith("custom") else run_setting(r, key)
                         for r in runs)
        else:
            got = _shown(run_setting(r, key) for r in runs)
        if NOT_RECORDED in got.split("/"):  # a runs.csv line: not compared, named by paper_differences
            continue
        if got != str(want):
            diffs.append(f"{key.replace('_', ' ')} {got} (paper {want})")
    return diffs


def _hessian_differences(paper_hessian: dict, runs) -> list[str]:
    analysed = [r.hessian for r in runs if r.hessian]
    diffs = []
    for key in _HESSIAN_COMPARED:
        want = paper_hessian.get(key, "-")
        got = _shown(((h.get("settings") or {}).get(key) if key != "samples" else h.get("num_samples"))
                     for h in analysed) if analysed else None
        if got is not None and key in paper_hessian and got != ("all" if want is None else str(want)):
            diffs.append(f"Hessian {key.replace('_', ' ')} {got} (paper {'all' if want is None else want})")
    return diffs


def paper_differences(spec: TableSpec, records) -> str | None:
    """What differs between the runs of ``spec``'s layout and the paper's setting (its table's ``paper`` preset):
    'differs from the paper: dataset fashion-mnist (paper cifar100); rounds 20 (paper 500); ...; Hessian samples
    2000 (paper all)'. None when the table has no paper preset or no run; 'same setting as the paper' when
    nothing differs."""
    from ..paper_tables import REPRODUCED

    table = REPRODUCED.get(spec.key)
    paper = (table.presets.get("paper") if table else None) or {}
    runs = records_of(spec, records)
    if not paper or not runs:
        return None
    diffs = _run_differences(paper.get("run", {}), runs) + _hessian_differences(paper.get("hessian", {}), runs)
    unknown = [key.replace("_", " ") for key in paper.get("run", {}) if key not in _BOOKKEEPING
               and any(run_setting(r, key) is NOT_RECORDED for r in runs)]
    if unknown:  # runs read from a runs.csv: what it does not record is not compared, and said
        unknown.append("Hessian settings" if paper.get("hessian") else "")
        text = "; ".join(diffs) + ("; " if diffs else "") + NOT_COMPARED + ", ".join(
            u for u in unknown if u)
        return "differs from the paper: " + text if diffs else text
    return "differs from the paper: " + "; ".join(diffs) if diffs else "same setting as the paper"
