"""The report-metric registry: every table names registered metrics; a metric registered from outside flows to a
table's CSV, Markdown and direction checks with no other file edited; lambda_1/lambda_5 is read from hessian.json's
record of it and is empty for an analysis of fewer than five eigenvalues."""
from __future__ import annotations

import csv
import dataclasses
import io
from pathlib import Path

import pytest

from flatfl.errors import ConfigError
from flatfl.paper_tables import REPRODUCED, TABLES
from flatfl.report.files import table_csv
from flatfl.report.layouts import paper_lookup, paper_values
from flatfl.report.markdown import report_markdown
from flatfl.report.metrics import (clients_needed, metric_names, metric_title, register_metric, report_metric,
                                   unregister_metric)
from flatfl.report.records import RunRecord
from flatfl.report.results import table_result


class Run(RunRecord):
    """A finished run record made in memory (no run folder): its Hessian result as hessian.json holds it."""

    @property
    def finished(self) -> bool:
        return True


def run(method: str, seed: int, eigenvalues: list[float], ratio: dict | None = None) -> Run:
    h = {"top_eigenvalues": eigenvalues, "trace": {"estimate": 10.0 * eigenvalues[0]}, "num_samples": 96,
         "settings": {"method": "lanczos", "tol": 0.01, "trace_method": "hutchpp", "trace_hvps": 9}}
    if ratio is not None:
        h["eigenvalue_ratio"] = ratio
    return Run(run_dir=Path(f"/nowhere/{method}-s{seed}"), config={"seed": seed}, method=method,
               partition="dirichlet-0.3", dataset="digits", seed=seed, rounds_done=2, hessian=h,
               model="clients-average")


def csv_rows(rows) -> list[dict]:
    return list(csv.DictReader(io.StringIO(table_csv(rows))))


def test_every_table_names_registered_metrics_and_only_a_papers_table_a_source():
    for key, spec in TABLES.items():
        assert set(spec.metrics) <= set(metric_names()), key
        assert (spec.source is None) == (spec.table is None), key
    assert TABLES["sam-family"].source is None  # no paper's table: its values come from also_tables only
    assert [k for k, s in TABLES.items() if clients_needed(s)] == [
        k for k, s in TABLES.items() if any(report_metric(m).cross_client for m in s.metrics)]
    assert metric_title("accuracy") == "accuracy (%)" and metric_title("not registered") == "not registered"


def test_registry_refuses_bad_entries_in_one_line():
    with pytest.raises(ConfigError, match="already registered"):
        register_metric("trace", "trace", lambda rec: None)
    with pytest.raises(ConfigError, match="name"):
        register_metric("Bad Name", "x", lambda rec: None)
    with pytest.raises(ConfigError, match="value must be a function"):
        register_metric("fine_name", "x", 3.0)
    with pytest.raises(ConfigError, match="value must be a function"):
        register_metric("fine_name", "x", None)
    with pytest.raises(ConfigError, match="runs.csv part"):
        register_metric("fine_name", "x", lambda rec: None, runs_csv=("values",))
    with pytest.raises(ConfigError, match="unknown metric 'nope'"):
        report_metric("nope")
    assert "fine_name" not in metric_names()


def test_a_registered_metric_flows_to_the_csv_markdown_and_checks():
    """A metric another package registers (lambda_1 - lambda_2, with a made-up paper's value under its own name)
    gets its CSV columns, its Markdown column and its direction checks in a layout that names it."""
    register_metric("eigen_gap", "eigenvalue gap", lambda rec: rec.hessian["top_eigenvalues"][0]
                    - rec.hessian["top_eigenvalues"][1], short="gap", paper_names=("gap_printed",),
                    setting=lambda rec: "demo setting", reading="lower: flatter")
    try:
        spec = dataclasses.replace(TABLES["man-table2"], key="made-up", source="Demo", table="Table 9",
                                   metrics=("top_eigenvalue", "eigen_gap"), also_tables=(),
                                   partitions=("dirichlet-0.3",))
        values = [{"source": "Demo", "table": "Table 9", "method": "FedAvg", "partition": "dirichlet-0.3",
                   "metric": "gap_printed", "value": 3.5},
                  {"source": "Demo", "table": "Table 9", "method": "FedAvg+MAN", "partition": "dirichlet-0.3",
                   "metric": "gap_printed", "value": 1.5}]
        runs = [run("FedAvg", 0, [10.0, 6.0]), run("FedAvg", 1, [12.0, 7.0]),
                run("FedAvg+MAN", 0, [8.0, 6.0]), run("FedAvg+MAN", 1, [9.0, 8.0])]
        result = table_result(spec, runs, None, values)
        fedavg = next(r for r in csv_rows(result.rows) if r["method"] == "FedAvg")
        assert float(fedavg["ours_eigen_gap"]) == pytest.approx((4.0 + 5.0) / 2)  # (10 - 6), (12 - 7)
        assert fedavg["ours_eigen_gap_n"] == "2" and fedavg["ours_eigen_gap_setting"] == "demo setting"
        assert float(fedavg["paper_eigen_gap"]) == 3.5
        md = report_markdown([result], "ours: demo", [], [])
        assert "| eigenvalue gap ours | eigenvalue gap paper |" in md
        assert "gap: demo setting" in md  # the settings line names it by its short label
        gap = [c for c in result.checks if c["metric"] == "eigen_gap"]
        assert [(c["reference"], c["compared"]) for c in gap] == [("FedAvg", "FedAvg+MAN")]
        assert gap[0]["ours_reference"] == pytest.approx(4.5) and gap[0]["ours_compared"] == pytest.approx(1.5)
        assert gap[0]["paper_change_pct"] == pytest.approx(100 * (1.5 - 3.5) / 3.5)
    finally:
        unregister_metric("eigen_gap")
    with pytest.raises(ConfigError, match="unknown metric"):
        report_metric("eigen_gap")


def test_eigenvalue_ratio_from_hessian_json_and_empty_without_five_eigenvalues():
    """lambda_1 / lambda_5 as hessian.json records it (hand values: 10 / 2.5 = 4, 12 / 4 = 3); an analysis of one
    eigenvalue (no record) leaves the cell empty, '-' in the Markdown, never an error."""
    spec = TABLES["sam-family"]
    assert spec.metrics.index("eigenvalue_ratio") == spec.metrics.index("trace") + 1
    runs = [run("FedAvg", 0, [10.0, 6.0, 4.0, 3.0, 2.5], {"k": 5, "value": 4.0}),
            run("FedAvg", 1, [12.0, 8.0, 6.0, 5.0, 4.0], {"k": 5, "value": 3.0}),
            run("FedSAM", 0, [7.0]), run("FedSAM", 1, [6.0])]
    result = table_result(spec, runs, None, paper_values())
    by = {r["method"]: r for r in csv_rows(result.rows)}
    assert float(by["FedAvg"]["ours_eigenvalue_ratio"]) == pytest.approx(3.5)
    assert float(by["FedAvg"]["ours_eigenvalue_ratio_sd"]) == pytest.approx(2 ** -0.5)  # sd of (4, 3)
    assert by["FedSAM"]["ours_eigenvalue_ratio"] == "" and by["FedSAM"]["ours_eigenvalue_ratio_n"] == "0"
    assert by["FedAvg"]["paper_eigenvalue_ratio"] == ""  # no paper publishes it for this protocol
    md = report_markdown([result], "ours: demo", [], [])
    line = next(x for x in md.splitlines() if x.startswith("| FedSAM | dirichlet-0.3"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    ratio_at = 3 + 2 * spec.metrics.index("eigenvalue_ratio")
    assert cells[ratio_at:ratio_at + 2] == ["-", "-"]
    # the settings line names the ratio with the top eigenvalue (the same analysis), only where it has values
    assert "λmax, λ1/λ5: all-clients average, lanczos (tol 0.01), 96 samples" in md
    assert "λ1/λ5" not in line


def test_sam_family_presets_ask_five_eigenvalues_and_the_man_tables_keep_one():
    for name, preset in REPRODUCED["sam-family"].presets.items():
        assert preset["hessian"]["top"] == 5, name
    for key in ("man-table2", "man-table6"):
        assert {p["hessian"]["top"] for p in REPRODUCED[key].presets.values()} == {1}


def test_man_accuracy_is_a_declared_table_not_a_special_case():
    """MAN Tables 2 and 6 publish no accuracy: their layouts name MAN Table 1 among their also_tables, whose
    'accuracy_after_500_rounds' is one of the accuracy metric's paper names; a layout that does not name it gets
    no accuracy from it, whatever its source."""
    values = paper_values()
    table1 = {(r["method"], r["partition"]): r["value"] for r in values
              if (r["source"], r["table"], r["metric"]) == ("MAN", "Table 1", "accuracy_after_500_rounds")}
    got = paper_lookup(TABLES["man-table2"], values)
    assert got[("FedAvg", "dirichlet-0.3", "accuracy")] == table1[("FedAvg", "dirichlet-0.3")] == 40.90
    bare = dataclasses.replace(TABLES["man-table2"], also_tables=())
    assert not any(m == "accuracy" for _, _, m in paper_lookup(bare, values))
