"""The report's contracts: typed table rows written with their fixed CSV columns, direction checks with theirs,
which layouts need cross-client results (from each table's metrics, never from its key), and no report module
growing past one job's size."""
from __future__ import annotations

import csv
import dataclasses
import io
from pathlib import Path


from flatfl.paper_tables import TABLES
from flatfl.report.files import ROW_COLUMNS, table_csv
from flatfl.report.metrics import clients_needed
from flatfl.report.missing import needs
from flatfl.report.tables import MetricCell, TableRow, build_table
from flatfl.report.verdicts import DIRECTION_COLUMNS, direction_checks

REPORT = Path(__file__).resolve().parent.parent / "flatfl" / "report"


class Run:
    """What build_table reads of a run."""

    def __init__(self, method, seed, value, partition="dirichlet-0.3", model="clients-average"):
        self.method, self.seed, self.partition, self.value_ = method, seed, partition, value
        self.name, self.model, self.dataset = f"{method}-s{seed}", model, "digits"
        self.hessian, self.clients = {}, None

    def value(self, metric):
        return self.value_ if metric == "top_eigenvalue" else None

    def stderr(self, metric):
        return None

    def setting(self, metric):
        return "same"


def _rows():
    runs = [Run("FedAvg", s, 10.0 + s) for s in (0, 1)] + [Run("FedAvg+MAN", s, 8.0 + s) for s in (0, 1)]
    return build_table(TABLES["man-table2"], runs, [])


def test_rows_are_typed_and_write_the_fixed_columns():
    rows = _rows()
    assert all(isinstance(r, TableRow) and set(r.cells) == set(TABLES["man-table2"].metrics) for r in rows)
    fa = next(r for r in rows if r.method == "FedAvg" and r.partition == "dirichlet-0.3")
    cell = fa.cells["top_eigenvalue"]
    assert isinstance(cell, MetricCell) and (cell.mean, cell.n, cell.by_seed) == (10.5, 2, {0: 10.0, 1: 11.0})
    header = next(csv.reader(io.StringIO(table_csv(rows))))
    per_metric = ["ours_{}_left_out", "ours_{}", "ours_{}_n", "ours_{}_sd", "ours_{}_se", "ours_{}_setting",
                  "ours_{}_mark", "paper_{}"]
    assert header == list(ROW_COLUMNS) + [c.format(m) for m in TABLES["man-table2"].metrics for c in per_metric]
    assert ROW_COLUMNS == ("table", "method", "paper_method", "partition", "model", "n_runs", "runs", "dataset",
                           "unfinished", "same_seed_left_out", "settings_not_changing_numbers")


def test_checks_carry_the_directions_columns_in_order():
    checks = direction_checks(TABLES["man-table2"], _rows())
    assert checks and all(tuple(c) == DIRECTION_COLUMNS for c in checks)
    assert {(c["reference"], c["compared"], c["metric"]) for c in checks} == {("FedAvg", "FedAvg+MAN",
                                                                                "top_eigenvalue")}


def test_cross_client_results_are_asked_by_the_layout_spec():
    assert [k for k, s in TABLES.items() if clients_needed(s)] == ["fedalign-table1"]
    run = Run("FedAvg", 0, 1.0, partition="dirichlet-0.3")
    run.hessian = {"top_eigenvalues": [1.0], "trace": {"estimate": 2.0}}
    plain = TABLES["man-table2"]
    assert needs(run, [plain]) == []
    # the same layout under another key, with an H_N column: its runs need H_N / H_D
    other = dataclasses.replace(plain, key="made-up", metrics=plain.metrics + ("hessian_norm_gap",))
    assert clients_needed(other) and needs(run, [other]) == ["clients"]


def test_the_one_experiment_rule_is_the_projects():
    from flatfl.report.experiments import NEUTRAL_SETTINGS, training_settings
    from flatfl.train.identity import experiment_settings
    from flatfl.utils.run_identity import NO_NUMBER_SETTINGS

    assert NEUTRAL_SETTINGS is NO_NUMBER_SETTINGS and training_settings is experiment_settings


def test_report_modules_stay_small():
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in REPORT.glob("*.py")}
    assert max(sizes.values()) < 400, sizes
