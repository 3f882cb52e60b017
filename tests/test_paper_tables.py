"""A table to reproduce is one module of flatfl/paper_tables (its layout and its run plan) plus its rows in
paper_values.csv: the command line's targets, the report's layouts and reproduce's plan all read the discovered
set, so a module dropped into a copy of the package is a new target of every command."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from flatfl import paper_tables
from flatfl.report.layouts import paper_values

ROOT = Path(__file__).resolve().parent.parent


def test_the_discovered_tables_and_their_order():
    """Properties, not a pinned list (a new table module must pass too): every module of the package that defines
    TABLE is a table and no other is; the tables come in (position, key) order; a group lists its tables in that
    order and its name follows its last table among the targets; the built-in tables are there."""
    import importlib

    from flatfl.paper_tables.table_spec import PaperTable

    modules = [p.stem for p in (ROOT / "flatfl" / "paper_tables").glob("*.py") if not p.stem.startswith("_")]
    defined = [getattr(importlib.import_module(f"flatfl.paper_tables.{m}"), "TABLE", None) for m in modules]
    tables = {t.key: t for t in defined if isinstance(t, PaperTable)}
    assert set(paper_tables.REPRODUCED) == set(tables)
    keys = list(paper_tables.REPRODUCED)
    assert keys == sorted(keys, key=lambda k: (tables[k].position, k))
    assert paper_tables.GROUPS == {g: tuple(k for k in keys if tables[k].group == g)
                                   for g in {t.group for t in tables.values() if t.group}}
    targets = list(paper_tables.TARGETS)
    assert [t for t in targets if t in tables] == keys and set(targets) == set(keys) | set(paper_tables.GROUPS)
    for group, members in paper_tables.GROUPS.items():
        assert targets.index(group) == targets.index(members[-1]) + 1
    assert {"man-table2", "man-table6", "fedalign-table1", "sam-family"} <= set(keys)
    assert paper_tables.GROUPS["man-tables"] == ("man-table2", "man-table6")


def test_every_table_has_paper_values_for_its_rows():
    values = paper_values()
    for key, spec in paper_tables.TABLES.items():
        mine = {(r["method"], r["partition"]) for r in values
                if spec.source is not None and (r["source"], r["table"]) == (spec.source, spec.table)}
        borrowed = {(r["method"], r["partition"]) for r in values
                    if (r["source"], r["table"]) in spec.also_tables and r["partition"] in spec.partitions
                    and r["method"] in {spec.paper_name(row) for row in spec.rows}}
        assert mine or borrowed, key
        assert {p for _, p in mine} <= set(spec.partitions), key


def test_a_layout_sets_the_values_of_other_tables_beside_the_rows_it_shares():
    """The SAM family has no paper table: the MAN paper's Table 2 and Table 6 values stand beside its FedAvg,
    FedSAM, FedASAM and FedSpeed rows, for delta 0.3 only (the layout's one partition)."""
    from flatfl.report.layouts import paper_lookup

    spec = paper_tables.TABLES["sam-family"]
    got = paper_lookup(spec, paper_values())
    assert got[("FedSAM", "dirichlet-0.3", "top_eigenvalue")] == 32.46  # MAN Table 2
    have = {(m, metric) for m, p, metric in got if metric in ("top_eigenvalue", "trace")}
    assert {m for m, _ in have} == {"FedAvg", "FedSAM", "FedSAM+MAN", "FedASAM", "FedASAM+MAN",
                                    "FedSpeed", "FedSpeed+MAN"}
    assert {p for _, p, metric in got if metric != "accuracy"} == {"dirichlet-0.3"}
    want = {r["value"] for r in paper_values() if r["table"] == "Table 6 (supplementary)" and r["method"] == "FedSpeed"
            and r["partition"] == "dirichlet-0.3" and r["metric"] == "trace"}
    assert {got[("FedSpeed", "dirichlet-0.3", "trace")]} == want


def test_the_sam_family_rows_and_the_code_each_follows():
    """The SAM family's rows: FedAvg, then each method without and with MAN (zeta 0.15), the layout's rows and the
    plan's methods in the same order; every method names the code it follows, and FedGMT and FedScar run at their
    algorithms' defaults (no setting but the algorithm)."""
    from flatfl.paper_tables.sam_family import BASES

    table = paper_tables.REPRODUCED["sam-family"]
    labels = [m.label for m in table.methods]
    assert labels == ["FedAvg"] + [label for base in BASES for label in (base, f"{base}+MAN")]
    assert tuple(labels) == table.spec.rows
    assert BASES[-2:] == ("FedGMT", "FedScar") and len(labels) == 25
    assert set(BASES) <= set(table.code_followed)
    settings = {m.label: m.settings for m in table.methods}
    for base, algo in (("FedGMT", "fedgmt"), ("FedScar", "fedscar")):
        assert settings[base] == {"algo": algo}
        assert settings[f"{base}+MAN"] == {"algo": algo, "reg": "man", "zeta": 0.15}
    assert "harrylee999/FL-SAM" in table.code_followed["FedGMT"]
    assert "Ultraman6/FedScar" in table.code_followed["FedScar"]


NEW_TABLE = '''
from .table_spec import Method, PaperTable, TableSpec, with_reg
from .man_common import PRESETS

SPEC = TableSpec(key="demo-table9", source="MAN", table="Table 9", title="a demo table", rows=("FedProx", "FedProx+MAN"),
                 partitions=("dirichlet-0.3",), metrics=("accuracy",), comparisons=with_reg(("FedProx",)),
                 paper_scale="paper: none")
TABLE = PaperTable(spec=SPEC, position=25, presets=PRESETS, alphas=(0.3,),
                   methods=(Method("FedProx", {"algo": "fedprox"}), Method("FedProx+MAN", {"algo": "fedprox", "reg": "man"})),
                   code_followed={"FedProx": "demo"})
'''
FIND = r"""
import json
from click.testing import CliRunner
from flatfl.cli import main
from flatfl.reproduce import Selection, plan
from flatfl.report.layouts import tables_for

help_text = CliRunner().invoke(main, ["reproduce", "--help"], terminal_width=200).output
print(json.dumps({"plan": sorted(t.name for t in plan(Selection("demo-table9", "tiny"), runs_dir="/tmp/x")),
                  "report": [s.key for s in tables_for(["demo-table9"])],
                  "choice": "demo-table9" in help_text.split("Options")[0]}))
"""


def test_a_table_module_dropped_into_a_copy_of_the_package_is_a_target(tmp_path):
    shutil.copytree(ROOT / "flatfl", tmp_path / "flatfl", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "flatfl" / "paper_tables" / "demo_table9.py").write_text(NEW_TABLE)
    r = subprocess.run([sys.executable, "-c", FIND], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(tmp_path), OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"plan": ["fedprox-dirichlet0.3-s0", "fedprox-man-dirichlet0.3-s0"], "report": ["demo-table9"],
                   "choice": True}
