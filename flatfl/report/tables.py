"""Report tables: each run's results collected from its directory, the papers' table layouts with their published
values beside ours, and the "X vs X+regularizer" direction checks.

* :func:`load_run` / :func:`collect_runs`: a run directory's config, accuracy curve and analysis results
  (``hessian/hessian.json``: top eigenvalues, trace, density, and its ``clients`` section for H_N / H_D;
  ``surface/surface.npz``).
* :data:`TABLES`: the layouts of MAN Table 2, MAN supplementary Table 6 and FedAlign Table 1 (rows, partitions,
  metrics, the comparisons the paper makes, the scale the paper ran at).
* :func:`build_table`: one row per (method, partition) of a layout: our value (mean over seeds, with its spread
  or standard error) beside the paper's (``paper_values.csv``, shipped with the package).
* :func:`direction_checks`: for each comparison, whether our change has the same sign as the paper's.

Method names follow the papers: the base algorithm's name (FedAvg, FedSAM = FedAvg with local SAM, FedDyn...),
then ``+`` and the regularizer's (FedAvg+MAN, FedAvg+Mixup). Partitions are written ``dirichlet-0.3``,
``fedml-dirichlet-0.5`` or ``iid``, as in ``paper_values.csv``.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..errors import ConfigError

__all__ = ["RunRecord", "load_run", "collect_runs", "find_run_dirs", "method_label", "partition_label",
           "TableSpec", "TABLES", "paper_values", "build_table", "direction_checks", "matching_tables",
           "scale_label", "METRIC_NAMES"]

ALGO_NAMES = {
    "fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD", "feddyn": "FedDyn", "feddc": "FedDC",
    "fedspeed": "FedSpeed", "fedsam": "FedSAM", "fedasam": "FedASAM", "fedcm": "FedCM", "mofedsam": "MoFedSAM",
    "mimelite": "MimeLite", "fedrobust": "FedRobust", "moon": "MOON", "fedntd": "FedNTD", "feddisco": "FedDisco",
}
REG_NAMES = {"man": "MAN", "asd": "ASD", "fedalign": "FedAlign", "gradaug": "GradAug", "mixup": "Mixup",
             "stochdepth": "StochDepth"}
OPT_NAMES = {"sam": "SAM", "asam": "ASAM"}
METRIC_NAMES = {
    "accuracy": "accuracy (%)",
    "top_eigenvalue": "top eigenvalue",
    "trace": "trace",
    "hessian_norm_gap": "H_N",
    "hessian_direction": "H_D",
}
LOWER_IS_FLATTER = {"top_eigenvalue", "trace", "hessian_norm_gap"}


# ---------------------------------------------------------------------------------------------- one run
def method_label(cfg: dict) -> str:
    """The paper-style name of a run's method: FedAvg, FedSAM, FedDyn+MAN, FedAvg+Mixup, FedDyn(SAM)+MAN..."""
    algo = str(cfg.get("algo", "fedavg")).lower()
    opt = str(cfg.get("local_opt", "sgd")).lower()
    reg = str(cfg.get("reg", "none")).lower()
    name = ALGO_NAMES.get(algo, algo)
    if opt in OPT_NAMES:
        name = {"fedavg": f"Fed{OPT_NAMES[opt]}"}.get(algo, f"{name}({OPT_NAMES[opt]})")
    if reg != "none":
        name += "+" + REG_NAMES.get(reg, reg)
    return name


def partition_label(cfg: dict) -> str:
    part = str(cfg.get("partition", "dirichlet"))
    return part if part == "iid" else f"{part}-{float(cfg.get('alpha', 0.3)):g}"


@dataclass
class RunRecord:
    """What the report knows about one run directory."""

    run_dir: Path
    config: dict
    method: str
    partition: str
    dataset: str
    seed: int
    rounds_done: int
    curve: list[dict] = field(default_factory=list)  # metrics.csv rows (numbers)
    hessian: dict | None = None  # hessian/hessian.json (the table's analysis)
    hessian_path: Path | None = None
    spectrum: dict | None = None  # spectrum/hessian.json (top-k and density for the Fig. 4 pages), if any
    surface_path: Path | None = None

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def finished(self) -> bool:
        return (self.run_dir / "final.pt").is_file()

    def accuracy(self, column: str) -> float | None:
        """The last evaluated ``column`` of metrics.csv, in percent."""
        for row in reversed(self.curve):
            v = row.get(column)
            if v is not None and math.isfinite(v):
                return 100.0 * v
        return None

    def value(self, metric: str, accuracy_column: str = "test_acc") -> float | None:
        h = self.hessian or {}
        if metric == "accuracy":
            return self.accuracy(accuracy_column)
        if metric == "top_eigenvalue":
            values = h.get("top_eigenvalues") or []
            return float(values[0]) if values else None
        if metric == "trace":
            tr = h.get("trace") or {}
            return None if tr.get("estimate") is None else float(tr["estimate"])
        if metric in ("hessian_norm_gap", "hessian_direction"):
            cl = h.get("clients") or {}
            v = cl.get("H_N" if metric == "hessian_norm_gap" else "H_D")
            return None if v is None else float(v)
        raise ConfigError(f"unknown metric {metric!r}")

    def stderr(self, metric: str) -> float | None:
        """The estimator's standard error of ``metric`` where the analysis gives one (trace, H_N, H_D)."""
        h = self.hessian or {}
        if metric == "trace":
            v = (h.get("trace") or {}).get("stderr")
        elif metric in ("hessian_norm_gap", "hessian_direction"):
            v = (h.get("clients") or {}).get("H_N_stderr" if metric == "hessian_norm_gap" else "H_D_stderr")
        else:
            v = None
        return None if v is None else float(v)


def _read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            parsed = {}
            for k, v in row.items():
                try:
                    parsed[k] = float(v) if v not in ("", None) else None
                except ValueError:
                    parsed[k] = None
            rows.append(parsed)
    return rows


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise ConfigError(f"{path} is not readable JSON; delete it to recompute it") from None


def load_run(run_dir: str | Path) -> RunRecord:
    """Read a run directory (config.json, metrics.csv, hessian/hessian.json, surface/surface.npz)."""
    d = Path(run_dir)
    f = d / "config.json"
    if not f.is_file():
        raise ConfigError(f"{d} is not a flatfl run directory (no config.json)")
    try:
        cfg = json.loads(f.read_text())["config"]
    except Exception:
        raise ConfigError(f"{f} is not a readable flatfl run config") from None
    from ..sweep import HESSIAN_DIR, SPECTRUM_DIR, SURFACE_DIR

    hessian_path = d / HESSIAN_DIR / "hessian.json"
    hessian = _read_json(hessian_path)
    spectrum = _read_json(d / SPECTRUM_DIR / "hessian.json")
    surface = d / SURFACE_DIR / "surface.npz"
    curve = _read_metrics(d / "metrics.csv")
    return RunRecord(run_dir=d, config=cfg, method=method_label(cfg), partition=partition_label(cfg),
                     dataset=str(cfg.get("dataset", "?")), seed=int(cfg.get("seed", 0)),
                     rounds_done=int(curve[-1]["round"]) if curve and curve[-1].get("round") else 0, curve=curve,
                     hessian=hessian, hessian_path=hessian_path if hessian else None, spectrum=spectrum,
                     surface_path=surface if surface.is_file() else None)


def find_run_dirs(paths) -> list[Path]:
    """Run directories among ``paths``: a path holding config.json is a run; any other directory contributes the
    runs directly inside it (so a sweep's or a reproduction's root can be passed as one argument)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if (p / "config.json").is_file():
            found.append(p)
        elif p.is_dir():
            inner = sorted(q for q in p.iterdir() if (q / "config.json").is_file())
            if not inner:
                runs = p / "runs"
                inner = sorted(q for q in runs.iterdir() if (q / "config.json").is_file()) if runs.is_dir() else []
            if not inner:
                raise ConfigError(f"{p} holds no flatfl run (no config.json in it or in its sub-directories)")
            found += inner
        else:
            raise ConfigError(f"run directory not found: {p}")
    unique = list(dict.fromkeys(q.resolve() for q in found))
    return unique


def collect_runs(paths) -> list[RunRecord]:
    return [load_run(d) for d in find_run_dirs(paths)]


# ---------------------------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class TableSpec:
    """A paper table's layout. ``rows`` are our method names; ``paper_names`` maps those the paper names
    differently; ``comparisons`` are (reference, compared) row pairs whose direction of change is checked."""

    key: str
    source: str  # "MAN" / "FedAlign", as in paper_values.csv
    table: str  # "Table 2", as in paper_values.csv
    title: str
    rows: tuple[str, ...]
    partitions: tuple[str, ...]
    metrics: tuple[str, ...]
    comparisons: tuple[tuple[str, str], ...]
    paper_scale: str
    accuracy_column: str = "test_acc"
    paper_names: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()

    def paper_name(self, row: str) -> str:
        return dict(self.paper_names).get(row, row)


def _with_reg(bases, reg="MAN"):
    return tuple((b, f"{b}+{reg}") for b in bases)


MAN_SCALE = ("paper: CIFAR-100, CNN (2 conv + 3 FC), 100 clients, 10% participation, 500 rounds x 5 local epochs, "
             "Hessian on the training set (assumed PyHessian protocol)")
TABLES: dict[str, TableSpec] = {
    "man-table2": TableSpec(
        key="man-table2", source="MAN", table="Table 2",
        title="MAN Table 2: top Hessian eigenvalue and trace, with and without MAN",
        rows=("FedAvg", "FedAvg+MAN", "FedSAM", "FedSAM+MAN", "FedDyn", "FedDyn+MAN", "FedDC", "FedDC+MAN"),
        partitions=("dirichlet-0.3", "dirichlet-0.6"), metrics=("top_eigenvalue", "trace", "accuracy"),
        comparisons=_with_reg(("FedAvg", "FedSAM", "FedDyn", "FedDC")), paper_scale=MAN_SCALE,
        accuracy_column="all_test_acc",
        notes=("accuracy: the average of all clients' latest models (MAN's protocol); the paper's accuracies are "
               "Table 1 ('accuracy_after_500_rounds').",
               "the paper's FedDC values are identical for delta 0.3 and 0.6.")),
    "man-table6": TableSpec(
        key="man-table6", source="MAN", table="Table 6 (supplementary)",
        title="MAN supplementary Table 6: FedASAM and FedSpeed with and without MAN",
        rows=("FedASAM", "FedASAM+MAN", "FedSpeed", "FedSpeed+MAN"),
        partitions=("dirichlet-0.3", "dirichlet-0.6"), metrics=("top_eigenvalue", "trace", "accuracy"),
        comparisons=_with_reg(("FedASAM", "FedSpeed")), paper_scale=MAN_SCALE, accuracy_column="all_test_acc",
        notes=("the paper's FedASAM and FedASAM+MAN values repeat its Table 2 FedAvg and FedAvg+MAN values digit for "
               "digit (probably a copy error); the FedASAM checks compare with those numbers.",)),
    "fedalign-table1": TableSpec(
        key="fedalign-table1", source="FedAlign", table="Table 1",
        title="FedAlign Table 1: accuracy, top eigenvalue, trace H_T and cross-client H_N, H_D",
        rows=("FedAvg", "FedProx", "MOON", "FedAvg+Mixup", "FedAvg+StochDepth", "FedAvg+GradAug",
              "FedAvg+FedAlign"),
        partitions=("fedml-dirichlet-0.5",),
        metrics=("accuracy", "top_eigenvalue", "trace", "hessian_norm_gap", "hessian_direction"),
        comparisons=(("FedAvg", "FedProx"), ("FedAvg", "MOON"), ("FedAvg", "FedAvg+Mixup"),
                     ("FedAvg", "FedAvg+StochDepth"), ("FedAvg", "FedAvg+GradAug"), ("FedAvg", "FedAvg+FedAlign")),
        paper_scale=("paper: CIFAR-100, ResNet-56, 16 clients all participating, Dirichlet 0.5 (FedML), 25 rounds x "
                     "20 local epochs, PyHessian power iteration and Hutchinson"),
        accuracy_column="test_acc",
        paper_names=(("FedAvg+Mixup", "Mixup"), ("FedAvg+StochDepth", "StochDepth"), ("FedAvg+GradAug", "GradAug")),
        notes=("FedAlign itself has no row in the paper's Table 1 (its accuracy is in Table 2 there); ours is shown "
               "without a paper value.",
               "H_N and H_D: cross-client Hessian diagonals (flatfl.analysis.clients); the protocol is recorded in "
               "each run's hessian.json.")),
}
TABLE_ALIASES = {"man-tables": ("man-table2", "man-table6")}


def paper_values() -> list[dict]:
    """The papers' published numbers (the shipped copy of shared/spec/paper_values.csv)."""
    text = resources.files("flatfl.report").joinpath("paper_values.csv").read_text(encoding="utf-8")
    rows = list(csv.DictReader(text.splitlines()))
    for r in rows:
        r["value"] = float(r["value"])
    return rows


def _paper_lookup(spec: TableSpec, values: list[dict]) -> dict:
    """(paper method, partition, metric) -> value for ``spec``; accuracy of MAN tables from MAN Table 1."""
    out = {}
    for r in values:
        if r["source"] != spec.source:
            continue
        metric = r["metric"]
        if r["table"] == spec.table:
            out[(r["method"], r["partition"], metric)] = r["value"]
        elif spec.source == "MAN" and r["table"] == "Table 1" and metric == "accuracy_after_500_rounds":
            out[(r["method"], r["partition"], "accuracy")] = r["value"]
    return out


def matching_tables(records: list[RunRecord]) -> list[str]:
    """The layouts that at least one run fills (a run of one of its methods on one of its partitions)."""
    keys = []
    for key, spec in TABLES.items():
        if any(r.method in spec.rows and r.partition in spec.partitions for r in records):
            keys.append(key)
    return keys


def _mean_and_spread(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, None
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var)


def scale_label(records: list[RunRecord]) -> str:
    """'ours: digits, digits-cnn, 20 clients, 50% participation (bernoulli), 50 rounds x 2 local epochs'."""
    if not records:
        return "ours: no runs"

    def one(key, fmt=str):
        vals = sorted({fmt(r.config.get(key)) for r in records}, key=str)
        return vals[0] if len(vals) == 1 else "/".join(vals)

    from ..config import RunConfig

    models = sorted({RunConfig.from_dict(r.config).resolved_model() for r in records})
    model = "/".join(models)
    part = one("participation", lambda p: f"{100 * float(p):g}%")
    seeds = sorted({r.seed for r in records})
    return (f"ours: {one('dataset')}, {model}, {one('clients')} clients, {part} participation "
            f"({one('sampling')}), {one('rounds')} rounds x {one('local_epochs')} local epochs, "
            f"{len(seeds)} seed(s)")


def build_table(spec: TableSpec, records: list[RunRecord], values: list[dict] | None = None) -> list[dict]:
    """One row per (method, partition) of ``spec``: our mean over the matching runs (``n`` of them), its spread
    over seeds (``_sd``) or the estimator's standard error for a single run (``_se``), and the paper's value."""
    paper = _paper_lookup(spec, values if values is not None else paper_values())
    rows = []
    for method in spec.rows:
        for part in spec.partitions:
            runs = [r for r in records if r.method == method and r.partition == part]
            row = {"table": spec.key, "method": method, "paper_method": spec.paper_name(method), "partition": part,
                   "n_runs": len(runs), "runs": ";".join(r.name for r in runs),
                   "dataset": ";".join(sorted({r.dataset for r in runs}))}
            for metric in spec.metrics:
                got = [v for v in (r.value(metric, spec.accuracy_column) for r in runs) if v is not None]
                mean, sd = _mean_and_spread(got)
                row[f"ours_{metric}"] = mean
                row[f"ours_{metric}_n"] = len(got)
                row[f"ours_{metric}_sd"] = sd
                ses = [r.stderr(metric) for r in runs]
                row[f"ours_{metric}_se"] = (math.sqrt(sum(s * s for s in ses)) / len(ses)
                                            if got and len(ses) == len(got) and all(s is not None for s in ses)
                                            else None)
                row[f"paper_{metric}"] = paper.get((spec.paper_name(method), part, metric))
            rows.append(row)
    return rows


def _sign(delta: float | None, tol: float = 0.0) -> int | None:
    if delta is None:
        return None
    return 0 if abs(delta) <= tol else (1 if delta > 0 else -1)


def direction_checks(spec: TableSpec, table_rows: list[dict]) -> list[dict]:
    """For each (reference, compared) pair, partition and metric where we have both values: our change and the
    paper's, and whether they point the same way. ``resolved`` says whether our change exceeds twice its combined uncertainty (seed spread,
    or the estimator's standard error), where one is known; None where none is."""
    by = {(r["method"], r["partition"]): r for r in table_rows}
    checks = []
    for ref, cmp_ in spec.comparisons:
        for part in spec.partitions:
            a, b = by.get((ref, part)), by.get((cmp_, part))
            if a is None or b is None:
                continue
            for metric in spec.metrics:
                oa, ob = a[f"ours_{metric}"], b[f"ours_{metric}"]
                if oa is None or ob is None:
                    continue  # nothing of ours to compare
                pa, pb = a[f"paper_{metric}"], b[f"paper_{metric}"]
                ours = None if oa is None or ob is None else ob - oa
                paper = None if pa is None or pb is None else pb - pa
                unc = None
                ua = a[f"ours_{metric}_sd"] if a[f"ours_{metric}_sd"] is not None else a[f"ours_{metric}_se"]
                ub = b[f"ours_{metric}_sd"] if b[f"ours_{metric}_sd"] is not None else b[f"ours_{metric}_se"]
                if ua is not None and ub is not None:
                    unc = math.sqrt(ua * ua + ub * ub)
                s_ours, s_paper = _sign(ours), _sign(paper)
                agrees = None if s_ours is None or s_paper is None else (s_ours == s_paper)
                checks.append({
                    "table": spec.key, "partition": part, "reference": ref, "compared": cmp_, "metric": metric,
                    "ours_reference": oa, "ours_compared": ob, "ours_change": ours,
                    "ours_change_pct": None if ours is None or not oa else 100.0 * ours / abs(oa),
                    "ours_uncertainty": unc,
                    "resolved": None if unc is None or ours is None else abs(ours) > 2 * unc,
                    "paper_reference": pa, "paper_compared": pb, "paper_change": paper,
                    "paper_change_pct": None if paper is None or not pa else 100.0 * paper / abs(pa),
                    "ours_direction": {1: "higher", -1: "lower", 0: "equal", None: None}[s_ours],
                    "paper_direction": {1: "higher", -1: "lower", 0: "equal", None: None}[s_paper],
                    "agrees": agrees,
                })
    return checks


def tables_for(keys) -> list[TableSpec]:
    """Table specs by key, expanding 'man-tables'; a bad key is a ConfigError."""
    out = []
    for k in keys:
        for kk in TABLE_ALIASES.get(k, (k,)):
            if kk not in TABLES:
                raise ConfigError(f"unknown table {k!r}: choose from {', '.join(list(TABLES) + list(TABLE_ALIASES))}")
            if TABLES[kk] not in out:
                out.append(TABLES[kk])
    return out
