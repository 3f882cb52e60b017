"""What the files of one run folder say, read for the report: ``metrics.csv``'s rows, every Hessian analysis
(``hessian*/hessian.json``, ``spectrum*/hessian.json``), every H_N / H_D result (``clients-<protocol>.json``, or the
'clients' section of a hessian.json), and which model and round each result measured.

The folder names are :mod:`flatfl.run_layout`'s; the file formats are read by :mod:`flatfl.analysis.commands.result_files`.
"""
from __future__ import annotations

import math

from pathlib import Path

from ..errors import ConfigError

__all__ = ["MODELS", "MODEL_NAMES", "MODEL_ACCURACY", "RECOMPUTE_HINT", "CLIENTS_PREFERENCE", "analysis_model",
           "measured_round", "read_metrics", "read_analyses", "clients_results", "protocol_order",
           "read_clients_metrics"]

MODELS = ("server", "clients-average")
MODEL_NAMES = {"server": "server", "clients-average": "all-clients average"}
MODEL_ACCURACY = {"server": "test_acc", "clients-average": "all_test_acc"}  # metrics.csv column of each model
RECOMPUTE_HINT = "delete it to recompute it"
CLIENTS_PREFERENCE = ("fedalign", "default")  # FedAlign's own protocol first: it made the paper's numbers
ANALYSIS_KINDS = ("hessian", "spectrum")  # the folders holding a hessian.json (each kind, suffixed by its model)


def analysis_model(h: dict | None) -> str | None:
    """Which model a hessian.json measured: 'clients-average' when its checkpoint is final-clients-average.pt,
    'server' for final.pt (or a round checkpoint); None when it does not say."""
    ck = str((h or {}).get("checkpoint") or "")
    name = Path(ck).name
    if name.startswith("final-clients-average"):
        return "clients-average"
    if name == "final.pt" or name.startswith("round_"):
        return "server"
    return None


def measured_round(data: dict | None) -> int | None:
    """The training round a derived result (hessian.json, its clients section, clients-*.json) says it measured."""
    r = (data or {}).get("round")
    return r if isinstance(r, int) and not isinstance(r, bool) else None


def _round_number(value) -> bool:
    """A round of metrics.csv: a whole number from 0 to 10^9."""
    return value is not None and math.isfinite(value) and value == int(value) and 0 <= value <= 10 ** 9


def read_metrics(path: Path) -> list[dict]:
    """metrics.csv's rows, every value a float (None where empty or not a number); [] without the file. A round that
    is not a whole number, a value beyond what result files hold (MAX_MAGNITUDE) or a column named twice is one line
    naming the file."""
    from ..analysis.commands.result_files import MAX_MAGNITUDE
    from .bounded import csv_rows

    if not path.is_file():
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; the file is damaged or not flatfl's") from None
    rows = []
    for line, row in csv_rows(text, path)[1]:  # a field over the bound is one line naming the file
        if None in row or any(v is None for v in row.values()):  # flatfl writes every row in full
            raise ConfigError(f"{path} line {line}: not as many fields as the header; the file is damaged or not "
                              "flatfl's")
        parsed = {}
        for k, v in row.items():
            try:
                parsed[k] = float(v) if isinstance(v, str) and v != "" else None
            except ValueError:
                parsed[k] = None
        huge = next((k for k, v in parsed.items() if v is not None and math.isfinite(v) and abs(v) > MAX_MAGNITUDE),
                    None)
        if huge is not None:  # beyond anything flatfl records (and what a figure's axis can draw)
            raise ConfigError(f"{path} line {line}: {huge} {row[huge]!r} is beyond what flatfl writes "
                              f"(+-{MAX_MAGNITUDE:g}); the file is damaged or not flatfl's")
        if "round" in parsed and not _round_number(parsed["round"]):  # the key of every curve drawn from it
            raise ConfigError(f"{path} line {line}: the round {row['round']!r} is not a round number; the file is "
                              "damaged or not flatfl's")
        rows.append(parsed)
    return rows


def read_analyses(run_dir: Path) -> dict[str, dict]:
    """Every Hessian analysis of a run, folder name -> hessian.json; one written before the checkpoint was recorded
    is of the server model (its checkpoint is set to the run's final.pt)."""
    from ..analysis.commands.result_files import read_hessian_file

    analyses = {}
    for sub in sorted(run_dir.iterdir()):
        if sub.is_dir() and sub.name.split("-")[0] in ANALYSIS_KINDS:
            h = read_hessian_file(sub / "hessian.json", RECOMPUTE_HINT)
            if h is not None:
                if analysis_model(h) is None:
                    h = dict(h, checkpoint=str(run_dir / "final.pt"))
                analyses[sub.name] = h
    return analyses


def clients_results(run_dir: Path, analyses: dict[str, dict], final_round: int | None = None) -> dict[str, dict]:
    """Every H_N / H_D result of a run, by protocol. ``flatfl hessian-clients`` writes each protocol into a file of
    its own (``clients-<protocol>.json``, in the run's hessian folder or the run itself); older runs hold one as the
    'clients' section of a hessian.json. For each protocol the first found in that order is used. With
    ``final_round``, a result that records another round (of a run resumed after it was measured) is not used."""
    from ..analysis.commands.result_files import read_clients_file
    from ..run_layout import CLIENTS_DIR

    def current(data):  # of the final round, and of the Hessian (another curvature's H_N is not the table's)
        curvature = (data.get("settings") or {}).get("curvature", "hessian") if isinstance(data, dict) else None
        return curvature == "hessian" and (final_round is None or measured_round(data) in (None, final_round))

    found: dict[str, dict] = {}
    for folder in (run_dir / CLIENTS_DIR, run_dir):
        for f in sorted(folder.glob("clients-*.json")) if folder.is_dir() else []:
            data = read_clients_file(f, RECOMPUTE_HINT)
            if data and data.get("H_N") is not None and current(data):
                proto = str(data.get("protocol") or (data.get("settings") or {}).get("protocol") or "default")
                found.setdefault(proto, dict(data, source=str(f.relative_to(run_dir))))
    for name, h in sorted(analyses.items()):
        cl = (h or {}).get("clients")
        if cl and cl.get("H_N") is not None and current(cl):
            proto = str(cl.get("protocol") or (cl.get("settings") or {}).get("protocol") or "default")
            found.setdefault(proto, dict(cl, source=f"{name}/hessian.json"))
    return found


def protocol_order(protocols) -> list[str]:
    """H_N / H_D protocols in :data:`CLIENTS_PREFERENCE` order, the others after them by name."""
    return sorted(protocols, key=lambda p: (CLIENTS_PREFERENCE.index(p) if p in CLIENTS_PREFERENCE else 99, p))


def read_clients_metrics(run_dir: Path, analyses: dict[str, dict], protocol: str | None = None,
                         final_round: int | None = None) -> dict | None:
    """H_N / H_D of a run (:func:`clients_results`): those of ``protocol``, or by default of the first protocol
    present in :data:`CLIENTS_PREFERENCE` order; None when there are none (of that protocol)."""
    found = clients_results(run_dir, analyses, final_round)
    if protocol is not None:
        return found.get(protocol)
    order = protocol_order(found)
    return found[order[0]] if order else None
