"""Report tables: each run's results collected from its directory, the papers' table layouts with their published
values beside ours, and the "X vs X+regularizer" direction checks.

* :func:`load_run` / :func:`collect_runs`: a run directory's config, accuracy curve and analysis results
  (``hessian/hessian.json``: top eigenvalues, trace, density, and its ``clients`` section for H_N / H_D;
  ``surface/surface.npz``).
* :data:`TABLES`: the layouts of the paper tables (rows, partitions, metrics, the comparisons the paper makes, the
  scale the paper ran at): MAN Table 2, MAN supplementary Table 6, FedAlign Table 1, one module each in
  :mod:`flatfl.paper_tables`.
* :func:`build_table`: one row per (method, partition) of a layout: our value (mean over seeds, with its spread
  or standard error) beside the paper's (``paper_values.csv``, shipped with the package).
* :func:`direction_checks`: for each comparison, whether our change has the same sign as the paper's.

Method names follow the papers: the base algorithm's name (FedAvg, FedSAM = FedAvg with local SAM, FedDyn...),
then ``+`` and the regularizer's (FedAvg+MAN, FedAvg+Mixup), each the ``display_name`` of its class in ``train/``. Partitions are written ``dirichlet-0.3``,
``fedml-dirichlet-0.5`` or ``iid``, as in ``paper_values.csv``.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

from ..errors import ConfigError, unknown_name
from ..paper_tables import GROUPS, TABLES, TableSpec
from ..train.catalog import display_name
from ..train.components import ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS
from ..train.identity import experiment_settings
from ..utils.run_identity import NO_NUMBER_SETTINGS

__all__ = ["RunRecord", "load_run", "collect_runs", "find_run_dirs", "method_label", "partition_label",
           "TableSpec", "TABLES", "paper_values", "build_table", "direction_checks", "matching_tables",
           "scale_label", "METRIC_NAMES", "MODELS", "MODEL_NAMES", "model_for", "read_clients_metrics",
           "analysis_model", "incomparable_notes", "VERDICTS", "check_runs_belong_together", "version_notices",
           "paper_differences", "NEUTRAL_SETTINGS", "training_settings", "TOO_FEW_SEEDS", "trained_differently",
           "experiment_notes"]

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
    name = display_name(ALGORITHMS, algo)
    if opt != "sgd" and opt in LOCAL_OPTIMIZERS:  # display_name loaded the registries
        opt_name = display_name(LOCAL_OPTIMIZERS, opt)
        name = f"Fed{opt_name}" if algo == "fedavg" else f"{name}({opt_name})"
    if reg != "none":
        name += "+" + display_name(REGULARIZERS, reg)
    return name


def partition_label(cfg: dict) -> str:
    part = str(cfg.get("partition", "dirichlet"))
    return part if part == "iid" else f"{part}-{float(cfg.get('alpha', 0.3)):g}"


MODELS = ("server", "clients-average")
MODEL_NAMES = {"server": "server", "clients-average": "all-clients average"}
MODEL_ACCURACY = {"server": "test_acc", "clients-average": "all_test_acc"}  # metrics.csv column of each model


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


def clients_results(run_dir: Path, analyses: dict[str, dict], final_round: int | None = None) -> dict[str, dict]:
    """Every H_N / H_D result of a run, by protocol. ``flatfl hessian-clients`` writes each protocol into a file of
    its own (``clients-<protocol>.json``, in the run's hessian folder or the run itself); older runs hold one as the
    'clients' section of a hessian.json. For each protocol the first found in that order is used. With
    ``final_round``, a result that records another round (of a run resumed after it was measured) is not used."""
    from ..analysis.result_files import read_clients_file

    def current(data):
        return final_round is None or measured_round(data) in (None, final_round)

    found: dict[str, dict] = {}
    for folder in (run_dir / "hessian", run_dir):
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


CLIENTS_PREFERENCE = ("fedalign", "default")  # FedAlign's own protocol first: it made the paper's numbers


def _protocol_order(protocols) -> list[str]:
    return sorted(protocols, key=lambda p: (CLIENTS_PREFERENCE.index(p) if p in CLIENTS_PREFERENCE else 99, p))


def read_clients_metrics(run_dir: Path, analyses: dict[str, dict], protocol: str | None = None,
                         final_round: int | None = None) -> dict | None:
    """H_N / H_D of a run (:func:`clients_results`): those of ``protocol``, or by default of the first protocol
    present in :data:`CLIENTS_PREFERENCE` order; None when there are none (of that protocol)."""
    found = clients_results(run_dir, analyses, final_round)
    if protocol is not None:
        return found.get(protocol)
    order = _protocol_order(found)
    return found[order[0]] if order else None


def choose_clients_protocol(records) -> str | None:
    """The H_N / H_D protocol a table uses: the one the most runs hold (ties: :data:`CLIENTS_PREFERENCE` order), so
    that a column is one protocol wherever the runs allow it; a run without it keeps its own (and is marked)."""
    held = [p for r in records for p in r.clients_all]
    if not held:
        return None
    return min(_protocol_order(set(held)), key=lambda p: -held.count(p))


@dataclass
class RunRecord:
    """What the report knows about one run directory. ``analyses`` holds every Hessian analysis found
    (folder name -> hessian.json); :meth:`select` picks the one of a model (and settings) as ``hessian``."""

    run_dir: Path
    config: dict
    method: str
    partition: str
    dataset: str
    seed: int
    rounds_done: int
    curve: list[dict] = field(default_factory=list)  # metrics.csv rows (numbers)
    hessian: dict | None = None  # the table's analysis (of ``model``)
    hessian_path: Path | None = None
    spectrum: dict | None = None  # the top-k and density for the Fig. 4 pages (of ``model``), if any
    surface_path: Path | None = None
    analyses: dict = field(default_factory=dict)
    clients: dict | None = None  # the H_N / H_D used (select_clients)
    model: str = "server"
    stale: dict = field(default_factory=dict)  # analyses of an earlier round than the run's last (folder -> round)
    clients_all: dict = field(default_factory=dict)  # protocol -> H_N / H_D results (clients_results)
    tracking: dict = field(default_factory=dict)  # config.json's curvature-tracking settings (--track-hessian)
    training_path: dict = field(default_factory=dict)  # config.json's record of how it trained (device, clients at once)
    weights_sha256: str | None = None  # the digest of final.pt's weights (a finished run)
    versions: dict = field(default_factory=dict)  # (flatfl, torch) -> what was made with them ('training', ...)

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def finished(self) -> bool:
        """Trained to its last round: final.pt written and metrics.csv reaching the rounds config.json asks for (a
        run killed earlier has only resume.pt and round checkpoints)."""
        rounds = self.config.get("rounds")
        rounds = rounds if isinstance(rounds, int) and not isinstance(rounds, bool) else None
        return (self.run_dir / "final.pt").is_file() and (rounds is None or self.rounds_done >= rounds)

    def candidates(self, model: str, kind: str = "hessian") -> list[str]:
        """Folders holding a ``kind`` ('hessian' or 'spectrum') analysis of ``model``, the canonical one first."""
        from ..runs import analysis_dir

        canon = analysis_dir(kind, model)
        names = [n for n, h in self.analyses.items() if n.split("-")[0] == kind and analysis_model(h) == model]
        return sorted(names, key=lambda n: (n != canon, n))

    def select(self, model: str, settings_ok: Callable[[dict], bool] | None = None) -> "RunRecord":
        """Use the analyses of ``model`` ('server' / 'clients-average'); with ``settings_ok`` only a Hessian
        analysis whose settings it accepts. Sets ``hessian``, ``spectrum``, ``surface_path``; returns self."""
        from ..runs import analysis_dir

        if model not in MODELS:
            raise unknown_name("model", model, MODELS)
        self.model = model
        names = [n for n in self.candidates(model) if settings_ok is None or settings_ok(self.analyses[n])]
        # the table needs a top eigenvalue and a trace: prefer an analysis that has both
        names.sort(key=lambda n: not (self.analyses[n].get("top_eigenvalues")
                                      and (self.analyses[n].get("trace") or {}).get("estimate") is not None))
        self.hessian = self.analyses[names[0]] if names else None
        self.hessian_path = self.run_dir / names[0] / "hessian.json" if names else None
        spec = self.candidates(model, "spectrum")
        self.spectrum = self.analyses[spec[0]] if spec else None
        surface = self.run_dir / analysis_dir("surface", model) / "surface.npz"
        self.surface_path = surface if surface.is_file() else None
        return self

    def select_clients(self, protocol: str | None) -> "RunRecord":
        """Use the H_N / H_D of ``protocol`` when the run has it, else its first in preference order."""
        order = _protocol_order(self.clients_all)
        pick = protocol if protocol in self.clients_all else (order[0] if order else None)
        self.clients = self.clients_all.get(pick) if pick else None
        return self

    @property
    def hessian_dir(self) -> str | None:
        return None if self.hessian_path is None else self.hessian_path.parent.name

    def accuracy(self, column: str) -> float | None:
        """The last evaluated ``column`` of metrics.csv, in percent."""
        for row in reversed(self.curve):
            v = row.get(column)
            if v is not None and math.isfinite(v):
                return 100.0 * v
        return None

    def value(self, metric: str, accuracy_column: str | None = None) -> float | None:
        """``metric`` of this run's selected model (accuracy: ``accuracy_column``, default the model's own)."""
        h = self.hessian or {}
        if metric == "accuracy":
            return self.accuracy(accuracy_column or MODEL_ACCURACY[self.model])
        if metric == "top_eigenvalue":
            values = h.get("top_eigenvalues") or []
            return float(values[0]) if values else None
        if metric == "trace":
            tr = h.get("trace") or {}
            return None if tr.get("estimate") is None else float(tr["estimate"])
        if metric in ("hessian_norm_gap", "hessian_direction"):
            cl = self.clients or {}
            v = cl.get("H_N" if metric == "hessian_norm_gap" else "H_D")
            return None if v is None else float(v)
        raise ConfigError(f"unknown metric {metric!r}")

    def stderr(self, metric: str) -> float | None:
        """The estimator's own error of ``metric`` where the analysis gives one: the trace's standard error, the top
        eigenvalue's error estimate (else its residual norm, a bound on the error), H_N / H_D's standard errors."""
        h = self.hessian or {}
        if metric == "trace":
            v = (h.get("trace") or {}).get("stderr")
        elif metric == "top_eigenvalue":
            est, res = h.get("error_estimates") or [], h.get("residuals") or []
            v = est[0] if est and est[0] is not None else (res[0] if res else None)
        elif metric in ("hessian_norm_gap", "hessian_direction"):
            v = (self.clients or {}).get("H_N_stderr" if metric == "hessian_norm_gap" else "H_D_stderr")
        else:
            v = None
        return None if v is None or not math.isfinite(float(v)) else abs(float(v))

    def setting(self, metric: str) -> str | None:
        """The settings that change ``metric``'s number, as one short string (model, method, samples, protocol);
        two runs whose strings differ must not be compared without a mark."""
        if metric == "accuracy":
            return MODEL_NAMES[self.model]
        if metric in ("hessian_norm_gap", "hessian_direction"):
            cl = self.clients or {}
            if not cl:
                return None
            s = cl.get("settings") or {}
            return (f"protocol {cl.get('protocol', s.get('protocol', '?'))}, probes {s.get('probes', '?')}, "
                    f"samples {s.get('samples') or 'all'}")
        h = self.hessian
        if not h:
            return None
        s = h.get("settings") or {}
        how = s.get("method", "?") if metric == "top_eigenvalue" else s.get("trace_method", "?")
        return f"{MODEL_NAMES[self.model]}, {how}, {h.get('num_samples', '?')} samples"


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


RECOMPUTE_HINT = "delete it to recompute it"


def load_run(run_dir: str | Path, model: str = "server") -> RunRecord:
    """Read a run directory (config.json, metrics.csv, every Hessian analysis, H_N / H_D, the loss surface) and
    select the analyses of ``model``."""
    d = Path(run_dir)
    f = d / "config.json"
    if not f.is_file():
        raise ConfigError(f"{d} is not a flatfl run directory (no config.json)")
    try:
        info = json.loads(f.read_text())
        cfg = info["config"]
    except Exception:
        raise ConfigError(f"{f} is not a readable flatfl run config") from None
    tracking = info.get("tracking") if isinstance(info.get("tracking"), dict) else {}
    path = info.get("training_path") if isinstance(info.get("training_path"), dict) else {}
    from ..analysis.result_files import read_hessian_file

    analyses = {}
    for sub in sorted(d.iterdir()):
        if sub.is_dir() and sub.name.split("-")[0] in ("hessian", "spectrum"):
            h = read_hessian_file(sub / "hessian.json", RECOMPUTE_HINT)
            if h is not None:
                if analysis_model(h) is None:  # written before the checkpoint was recorded: the server model
                    h = dict(h, checkpoint=str(d / "final.pt"))
                analyses[sub.name] = h
    curve = _read_metrics(d / "metrics.csv")
    rounds_done = int(curve[-1]["round"]) if curve and curve[-1].get("round") else 0
    # A Hessian of an earlier round (measured before the run was resumed) is never shown beside the final accuracy.
    final_round = cfg.get("rounds") if (d / "final.pt").is_file() else None  # a finished run trained them all
    final_round = final_round if isinstance(final_round, int) and not isinstance(final_round, bool) else None
    stale = {n: measured_round(h) for n, h in analyses.items()
             if final_round is not None and measured_round(h) not in (None, final_round)}
    analyses = {n: h for n, h in analyses.items() if n not in stale}
    clients_all = clients_results(d, analyses, final_round)
    digests = _check_provenance(d, cfg, rounds_done, analyses, clients_all)
    rec = RunRecord(run_dir=d, config=cfg, method=method_label(cfg), partition=partition_label(cfg),
                    dataset=str(cfg.get("dataset", "?")), seed=int(cfg.get("seed", 0)),
                    rounds_done=rounds_done, curve=curve, analyses=analyses,
                    clients_all=clients_all, stale=stale, tracking=tracking, training_path=path,
                    weights_sha256=digests.get("server"),
                    versions=_versions(d, analyses, clients_all))
    return rec.select(model).select_clients(None)


def _check_provenance(d: Path, cfg: dict, rounds_done: int, analyses: dict, clients_all: dict) -> dict:
    """Every result of a finished run checked against the run it sits in (one ConfigError line naming both
    digests otherwise): config.json's training settings are final.pt's (a hand-edited config.json would file the
    run under another algorithm), metrics.csv reaches final.pt's round (a truncated one would pair an early
    accuracy with a later Hessian), and each hessian.json, clients-*.json and surface.json measured the weights of
    the model it names (not another run's, copied in). Returns {'server': digest, 'clients-average': digest}."""
    from ..analysis.result_files import read_surface_file
    from ..checkpoint import read_checkpoint
    from ..runs import MODEL_CHECKPOINTS, analysis_dir
    from ..utils.provenance import differing_settings, settings_digest, short, state_digest

    final = d / "final.pt"
    if not final.is_file():
        return {}
    payload = read_checkpoint(final)
    trained = payload["config"]
    changed = differing_settings(cfg, trained)
    if changed:
        shown = ", ".join(f"{k} {cfg.get(k)!r} (final.pt: {trained.get(k)!r})" for k in changed[:3])
        raise ConfigError(f"{d / 'config.json'} does not describe the run final.pt holds ({shown}; run settings "
                          f"sha256 {short(settings_digest(cfg))} vs {short(settings_digest(trained))}): it was "
                          "edited; restore it")
    if rounds_done < payload["round"]:
        raise ConfigError(f"{d / 'metrics.csv'} stops at round {rounds_done} but final.pt is of round "
                          f"{payload['round']}: metrics.csv is truncated or of another run; its accuracy would be "
                          "shown beside results of a later model")
    digests = {"server": state_digest(payload["state_dict"])}
    if isinstance(payload.get("all_state_dict"), dict):
        digests["clients-average"] = state_digest(payload["all_state_dict"])

    def check(what: str, data: dict, model: str) -> None:
        recorded, expected = data.get("weights_sha256"), digests.get(model)
        if isinstance(recorded, str) and expected is not None and recorded != expected:
            raise ConfigError(f"{what} measured weights sha256 {short(recorded)}, but this run's "
                              f"{MODEL_CHECKPOINTS[model]} holds {short(expected)}: it belongs to another run "
                              f"(copied in?); {RECOMPUTE_HINT}")
        r = measured_round(data)
        if r is not None and r > rounds_done:
            raise ConfigError(f"{what} measured round {r}, but {d / 'metrics.csv'} stops at round {rounds_done}; "
                              "metrics.csv is truncated or of another run")

    for name, h in sorted(analyses.items()):
        check(str(d / name / "hessian.json"), h, analysis_model(h) or "server")
    for proto, data in sorted(clients_all.items()):
        check(str(d / data.get("source", "?")), data, "server")
    for model in MODELS:
        f = d / analysis_dir("surface", model) / "surface.json"
        data = read_surface_file(f, RECOMPUTE_HINT)
        if data is not None:
            check(str(f), data, model)
    return digests


def _versions(d: Path, analyses: dict, clients_all: dict) -> dict:
    """(flatfl, torch) -> what of the run was made with them: 'training' (config.json's environment) and each
    analysis folder."""
    out: dict = {}
    try:
        env = json.loads((d / "config.json").read_text()).get("environment") or {}
    except (OSError, ValueError, AttributeError):
        env = {}
    try:
        resumed = json.loads((d / "config.json").read_text()).get("resumed") or []
    except (OSError, ValueError, AttributeError):
        resumed = []
    for what, e in [("training", env)] + [(f"training from round {r.get('from_round')}", r.get("environment"))
                                          for r in resumed if isinstance(r, dict)]:
        if isinstance(e, dict) and e.get("flatfl") and e.get("torch"):
            out.setdefault((str(e["flatfl"]), str(e["torch"])), []).append(what)
    for name, data in [(n, h) for n, h in sorted(analyses.items())] + \
            [(str(c.get("source")), c) for _, c in sorted(clients_all.items())]:
        if data.get("flatfl_version") and data.get("torch_version"):
            out.setdefault((str(data["flatfl_version"]), str(data["torch_version"])), []).append(name)
    return out


def check_runs_belong_together(records) -> None:
    """Refuse two runs holding the same final weights (a copy of one run would count as a second seed and shrink
    the standard error)."""
    from ..utils.provenance import short

    seen: dict = {}
    for r in records:
        digest = getattr(r, "weights_sha256", None)
        if digest is None:
            continue
        if digest in seen:
            raise ConfigError(f"{seen[digest].run_dir} and {r.run_dir} hold the same final weights (sha256 "
                              f"{short(digest)}): one is a copy of the other and would count as a second seed; "
                              "report only one of them")
        seen[digest] = r


def version_notices(records) -> list[str]:
    """A notice when the runs and their analyses were made with more than one flatfl / torch version."""
    used: dict = {}
    for r in records:
        for pair, what in (getattr(r, "versions", None) or {}).items():
            used.setdefault(pair, []).extend(f"{r.name}: {w}" for w in what)
    if len(used) < 2:
        return []
    parts = [f"flatfl {f} / torch {t} ({len(w)}: {', '.join(w[:3])}{', ...' if len(w) > 3 else ''})"
             for (f, t), w in sorted(used.items())]
    return ["runs and analyses made with different flatfl / torch versions; numbers may differ in their last digits "
            "between them: " + "; ".join(parts)]


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


def collect_runs(paths, model: str = "server") -> list[RunRecord]:
    records = [load_run(d, model) for d in find_run_dirs(paths)]
    check_runs_belong_together(records)
    return records


# ---------------------------------------------------------------------------------------------- layouts
# the layouts: one module per table in flatfl/paper_tables (TableSpec is defined there)
TABLE_ALIASES = GROUPS


def paper_values() -> list[dict]:
    """The papers' published numbers (flatfl/report/paper_values.csv)."""
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

    from ..train.config import RunConfig

    models = sorted({RunConfig.from_dict(r.config).resolved_model()
                     + (f" {r.config['model_args']}" if r.config.get("model_args") else "") for r in records})
    model = "/".join(models)
    part = one("participation", lambda p: f"{100 * float(p):g}%")
    seeds = sorted({r.seed for r in records})
    return (f"ours: {one('dataset')}, {model}, {one('clients')} clients, {part} participation "
            f"({one('sampling')}), {one('rounds')} rounds x {one('local_epochs')} local epochs, "
            f"{len(seeds)} seed(s); {training_path_label(records)}")


def training_path_label(records: list[RunRecord]) -> str:
    """Which computation trained the runs (config.json's ``training_path``): 'trained on cpu, one client at a time,
    float32 full' (', steps as CUDA graphs' when ``--cuda-graphs`` was on); several values joined by '/'; runs from
    before the record named as such."""
    paths = [r.training_path for r in records if r.training_path]
    if not paths:
        return "training path not recorded"

    def values(key, fmt=str):
        return "/".join(sorted({fmt(p.get(key, "?")) for p in paths}, key=str))

    def clients(k):
        return "one client at a time" if k == 1 else f"{k} clients at once"

    devices = values("device", lambda d: str(d))
    names = sorted({str(p["device_name"]) for p in paths if p.get("device_name")})
    label = (f"trained on {devices}{' (' + '/'.join(names) + ')' if names else ''}, {values('clients_at_once', clients)}, "
             f"float32 {values('float32_matmul')}")
    graphed = sum(1 for p in paths if p.get("cuda_graphs") is True)
    if graphed:
        label += ", steps as CUDA graphs" + ("" if graphed == len(paths) else f" in {graphed} of {len(paths)} runs")
    missing = len(records) - len(paths)
    return label + (f" ({missing} run(s) without a record)" if missing else "")


_BOOKKEEPING = ("eval_every", "checkpoint_every", "save_clients", "device", "seed")
_HESSIAN_COMPARED = ("method", "trace_method", "trace_hvps", "samples")


def paper_differences(spec: TableSpec, records: list[RunRecord]) -> str | None:
    """What differs between the runs of ``spec``'s layout and the paper's setting (its table's ``paper`` preset):
    'differs from the paper: dataset fashion-mnist (paper cifar100); rounds 20 (paper 500); ...; Hessian samples
    2000 (paper all)'. None when the table has no paper preset or no run; 'same setting as the paper' when
    nothing differs."""
    from ..paper_tables import REPRODUCED
    from ..train.config import RunConfig

    table = REPRODUCED.get(spec.key)
    paper = (table.presets.get("paper") if table else None) or {}
    runs = [r for r in records if r.method in spec.rows and r.partition in spec.partitions]
    if not paper or not runs:
        return None

    def ours(values) -> str:
        vals = sorted({"all" if v is None else str(v) for v in values}, key=str)
        return "/".join(vals)

    diffs = []
    for key, want in paper.get("run", {}).items():
        if key in _BOOKKEEPING:
            continue
        if key == "model":
            got = ours(RunConfig.from_dict(r.config).resolved_model() for r in runs)
            args = ours(str(r.config.get("model_args") or "") for r in runs)
            if args:
                got += f" {args}"
        else:
            got = ours(r.config.get(key) for r in runs)
        if got != str(want):
            diffs.append(f"{key.replace('_', ' ')} {got} (paper {want})")
    analysed = [r.hessian for r in runs if r.hessian]
    for key in _HESSIAN_COMPARED:
        want = paper.get("hessian", {}).get(key, "-")
        got = ours(((h.get("settings") or {}).get(key) if key != "samples" else h.get("num_samples"))
                   for h in analysed) if analysed else None
        if got is not None and key in paper.get("hessian", {}) and got != ("all" if want is None else str(want)):
            diffs.append(f"Hessian {key.replace('_', ' ')} {got} (paper {'all' if want is None else want})")
    return "differs from the paper: " + "; ".join(diffs) if diffs else "same setting as the paper"


def model_for(spec: TableSpec, model: str | None) -> str:
    """The model whose numbers fill ``spec``'s rows: ``model`` when given, else the layout's default.

    MAN (main paper, Sec. 5: "we follow the protocol of [FedDyn], where we take the average of all the client
    models for reporting accuracy"; docs/update-rules.md: the official scripts keep ``tst_perf_all``) reports the
    all-clients average; its Hessian is said to be "the global model's" without naming which, so the MAN layouts
    measure the all-clients average for every column, accuracy and Hessian alike. FedAlign evaluates the server
    (global) model; with all clients joining every round, FedAvg's server model is that average anyway."""
    m = model or spec.default_model
    if m not in MODELS:
        raise unknown_name("model", m, MODELS)
    return m


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    return _mean_and_spread(values)


#: run settings that change no number beyond rounding (:mod:`flatfl.utils.run_identity`): runs differing only in
#: these are seeds of one experiment; the differences are shown.
NEUTRAL_SETTINGS = NO_NUMBER_SETTINGS
_NEUTRAL_SHOWN = tuple(k for k in NEUTRAL_SETTINGS if k not in ("out", "quiet"))  # out differs for every run
_METHOD_KEYS = ("algo", "local_opt", "reg")
#: what decides a run's numbers besides its seed (:func:`flatfl.train.identity.experiment_settings`)
training_settings = experiment_settings


def _shown_value(v) -> str:
    return "default" if v is None else format(v, "g") if isinstance(v, float) else str(v)


def _neutral_differences(runs) -> str:
    """'threads 1 / 2; parallel-clients 1 / 4': the settings of :data:`NEUTRAL_SETTINGS` in which the runs differ."""
    from ..train.config import with_defaults

    configs = [with_defaults(r.config) for r in runs if isinstance(getattr(r, "config", None), dict)]
    parts = []
    for key in _NEUTRAL_SHOWN:
        vals = list(dict.fromkeys(_shown_value(c.get(key)) for c in configs))
        if len(vals) > 1:
            parts.append(f"{key.replace('_', '-')} {' / '.join(vals)}")
    return "; ".join(parts)


def _one_run_per_seed(runs, metrics) -> tuple[list, list]:
    """Two runs of one seed (trained with other thread or client-cohort counts, say) are one experiment, not two
    seeds: keep one per seed (the one with the most values, then the first by name) and return (kept, [(left out,
    kept instead)])."""
    by_seed: dict[int, list] = {}
    for r in runs:
        by_seed.setdefault(int(r.seed), []).append(r)
    keep, dropped = set(), []
    for seed, rs in by_seed.items():
        rs = sorted(rs, key=lambda r: (-sum(r.value(m) is not None for m in metrics), str(r.name)))
        keep.add(id(rs[0]))
        dropped += [(r, rs[0]) for r in rs[1:]]
    return [r for r in runs if id(r) in keep], dropped


def build_table(spec: TableSpec, records: list[RunRecord], values: list[dict] | None = None) -> list[dict]:
    """One row per (method, partition) of ``spec``: our mean over the matching runs' values (``_n`` of them), the
    standard deviation over seeds (``_sd``, two or more runs), the estimator's own error of that mean (``_se``:
    sqrt(sum se_i^2) / n, where every run has one), the settings that made the number (``_setting``; 'mixed: ...'
    when the runs differ) and the paper's value. The records must already hold the model to report
    (:meth:`RunRecord.select`); the row names it (``model``).

    A row is one experiment: its finished runs of distinct seeds, trained alike (:func:`training_settings`; other
    settings refused). A run not finished is in no column (``unfinished``); a second run of a seed counts once
    (``same_seed_left_out``); settings that change no number (:data:`NEUTRAL_SETTINGS`) do not split the row and are
    named where its runs differ in them (``settings_not_changing_numbers``); ``training`` keeps the row's settings
    for :func:`direction_checks`."""
    paper = _paper_lookup(spec, values if values is not None else paper_values())
    chosen = [r for r in records if r.method in spec.rows and r.partition in spec.partitions]
    # per metric, the settings most runs of the layout used: a row whose runs differ averages only those
    common = {}
    for metric in spec.metrics:
        used = [st for st in (getattr(r, "setting", lambda m: None)(metric) for r in chosen
                              if r.value(metric) is not None) if st is not None]
        common[metric] = max(sorted(set(used)), key=used.count) if used else None
    rows = []
    for method in spec.rows:
        for part in spec.partitions:
            every = [r for r in records if r.method == method and r.partition == part]
            # a run killed before its last round is no seed of the experiment: listed, used in no column
            unfinished = [r for r in every if not getattr(r, "finished", True)]
            runs = [r for r in every if getattr(r, "finished", True)]
            _check_same_settings(spec, method, part, runs)
            runs, same_seed = _one_run_per_seed(runs, spec.metrics)
            models = sorted({getattr(r, "model", "server") for r in runs})
            row = {"table": spec.key, "method": method, "paper_method": spec.paper_name(method), "partition": part,
                   "model": "/".join(MODEL_NAMES.get(m, m) for m in models), "n_runs": len(runs),
                   "runs": ";".join(r.name for r in runs), "dataset": ";".join(sorted({r.dataset for r in runs})),
                   "unfinished": "; ".join(f"{r.name} ({getattr(r, 'rounds_done', '?')}/"
                                           f"{(getattr(r, 'config', None) or {}).get('rounds', '?')} rounds)"
                                           for r in unfinished),
                   "same_seed_left_out": "; ".join(f"{r.name} (seed {r.seed}, as {k.name})" for r, k in same_seed),
                   "settings_not_changing_numbers": _neutral_differences(runs),
                   "training": (training_settings(runs[0].config)
                                if runs and isinstance(getattr(runs[0], "config", None), dict) else None)}
            for metric in spec.metrics:
                have = [(r, v) for r, v in ((r, r.value(metric)) for r in runs) if v is not None]
                setting_of = {id(r): getattr(r, "setting", lambda m: None)(metric) for r, _ in have}
                kinds = [setting_of[id(r)] for r, _ in have]
                if len(set(kinds)) > 1:  # never average numbers made with different settings
                    keep = common[metric] if common[metric] in kinds else \
                        max(sorted(set(kinds), key=str), key=kinds.count)
                    row[f"ours_{metric}_left_out"] = "; ".join(
                        f"{r.name} ({setting_of[id(r)]})" for r, _ in have if setting_of[id(r)] != keep)
                    have = [(r, v) for r, v in have if setting_of[id(r)] == keep]
                else:
                    row[f"ours_{metric}_left_out"] = ""
                got = [v for _, v in have]
                by_seed: dict[int, list[float]] = {}
                for r, v in have:
                    by_seed.setdefault(int(r.seed), []).append(v)
                # per seed (two runs of one seed: their mean), for the verdicts paired by seed
                row[f"ours_{metric}_by_seed"] = {sd_: sum(vs) / len(vs) for sd_, vs in sorted(by_seed.items())}
                mean, sd = _mean_sd(got)
                row[f"ours_{metric}"] = mean
                row[f"ours_{metric}_n"] = len(got)
                row[f"ours_{metric}_sd"] = sd
                ses = [r.stderr(metric) for r, _ in have]
                row[f"ours_{metric}_se"] = (math.sqrt(sum(x * x for x in ses)) / len(ses)
                                            if ses and all(x is not None for x in ses) else None)
                settings = sorted({st for st in (getattr(r, "setting", lambda m: None)(metric) for r, _ in have)
                                   if st is not None})
                row[f"ours_{metric}_setting"] = (settings[0] if len(settings) == 1 else
                                                 "mixed: " + " | ".join(settings) if settings else None)
                row[f"ours_{metric}_mark"] = ""
                row[f"paper_{metric}"] = paper.get((spec.paper_name(method), part, metric))
            rows.append(row)
    _mark_incomparable(spec, rows)
    return rows


def _check_same_settings(spec: TableSpec, method: str, part: str, runs) -> None:
    """The runs averaged in one row are seeds of one experiment: refuse runs trained with other settings (another
    lr, round count, client count...) than the row's first, naming the settings and both settings digests."""
    from ..utils.provenance import json_digest, short

    configs = [(r, training_settings(r.config)) for r in runs if isinstance(getattr(r, "config", None), dict)]
    for r, cfg in configs[1:]:
        first, base = configs[0]
        changed = sorted(k for k in set(base) | set(cfg) if base.get(k) != cfg.get(k))
        if changed:
            shown = ", ".join(f"{k} {base.get(k)!r} vs {cfg.get(k)!r}" for k in changed[:3])
            raise ConfigError(f"{spec.key} row {method} {part}: {first.name} and {r.name} were trained with other "
                              f"settings ({shown}; settings sha256 {short(json_digest(base))} vs "
                              f"{short(json_digest(cfg))}) and cannot be averaged as seeds; report them separately")


def _mark_incomparable(spec: TableSpec, rows: list[dict]) -> None:
    """A dagger on every value computed with settings other than the column's most common ones (or mixed)."""
    for metric in spec.metrics:
        settings = [r[f"ours_{metric}_setting"] for r in rows if r[f"ours_{metric}"] is not None]
        if not settings:
            continue
        common = max(sorted(set(settings)), key=settings.count)
        for r in rows:
            if r[f"ours_{metric}"] is not None and (r[f"ours_{metric}_setting"] != common
                                                    or common.startswith("mixed")):
                r[f"ours_{metric}_mark"] = "†"


def incomparable_notes(spec: TableSpec, rows: list[dict]) -> list[str]:
    """The footnotes of the daggers of :func:`_mark_incomparable` (empty when every column is one protocol)."""
    out = []
    for metric in spec.metrics:
        marked = [r for r in rows if r[f"ours_{metric}_mark"]]
        if not marked:
            continue
        settings = [r[f"ours_{metric}_setting"] for r in rows if r[f"ours_{metric}"] is not None]
        common = max(sorted(set(settings)), key=settings.count)
        what = "; ".join(f"{r['method']} {r['partition']}: {r[f'ours_{metric}_setting']}" for r in marked)
        out.append(f"† {METRIC_NAMES.get(metric, metric)} computed with other settings than the rest of its column "
                   f"({common}): {what}. Not comparable without caution; direction checks between them are "
                   "marked 'incomparable'.")
    for metric in spec.metrics:
        left = [r for r in rows if r.get(f"ours_{metric}_left_out")]
        if left:
            out.append(f"{METRIC_NAMES.get(metric, metric)}: runs made with other settings than the rest of their row "
                       "are left out of its mean: " + "; ".join(
                           f"{r['method']} {r['partition']}: {r[f'ours_{metric}_left_out']}" for r in left))
    return out + experiment_notes(spec, rows)


def experiment_notes(spec: TableSpec, rows: list[dict]) -> list[str]:
    """What keeps each row one experiment: runs not finished (in no column), second runs of a seed (counted once),
    the settings that change no number in which a row's runs differ (shown, not splitting the row), and pairs of
    rows trained differently in anything but the method (their checks 'incomparable')."""
    out = []
    unfinished = [f"{r['method']} {r['partition']}: {r['unfinished']}" for r in rows if r.get("unfinished")]
    if unfinished:
        out.append("runs not finished, left out of every column (resume them with flatfl train --resume): "
                   + "; ".join(unfinished))
    same = [f"{r['method']} {r['partition']}: {r['same_seed_left_out']}" for r in rows if r.get("same_seed_left_out")]
    if same:
        out.append("a seed trained more than once counts once (its runs differ only in settings that change no "
                   "number beyond rounding); left out: " + "; ".join(same))
    neutral = [f"{r['method']} {r['partition']}: {r['settings_not_changing_numbers']}" for r in rows
               if r.get("settings_not_changing_numbers")]
    if neutral:
        out.append("seeds of one row ran with different settings that change no number beyond rounding: "
                   + "; ".join(neutral))
    by = {(r["method"], r["partition"]): r for r in rows}
    for ref, cmp_ in spec.comparisons:
        for part in spec.partitions:
            a, b = by.get((ref, part)), by.get((cmp_, part))
            diff = trained_differently(spec, a, b) if a and b and a["n_runs"] and b["n_runs"] else []
            if diff:
                out.append(f"{cmp_} vs {ref} {part}: trained differently ({', '.join(diff)}): not the same "
                           "experiment, its direction checks are 'incomparable'")
    return out


def _sign(delta: float | None, tol: float = 0.0) -> int | None:
    if delta is None:
        return None
    return 0 if abs(delta) <= tol else (1 if delta > 0 else -1)


def _mean_error(row: dict, metric: str) -> tuple[float | None, str]:
    """Standard error of a row's mean and where it comes from: sd / sqrt(n) over seeds ('n=3', n >= 2), else the
    estimator's own error ('est.'), else none."""
    n, sd, se = row[f"ours_{metric}_n"], row[f"ours_{metric}_sd"], row[f"ours_{metric}_se"]
    if n >= 2 and sd is not None:
        return sd / math.sqrt(n), f"n={n}"
    if se is not None:
        return se, "est."
    return None, "none"


TOO_FEW_SEEDS = "too few seeds"
VERDICTS = ("agree", "disagree", "inconclusive", "incomparable", TOO_FEW_SEEDS)


def _method_keys(spec: TableSpec, *methods: str) -> set[str]:
    """The settings that make ``methods`` what they are in ``spec``'s plan (the algorithm, optimizer and regularizer,
    and what each method sets: its hyper-parameters, FedAlign's clipping), as :func:`training_settings` keys."""
    from ..paper_tables import REPRODUCED

    keys = set(_METHOD_KEYS)
    table = REPRODUCED.get(spec.key)
    planned = [m.settings for m in (table.methods if table else ()) if m.label in methods]
    # a setting the plan gives the methods alike is no part of what tells them apart
    for settings in planned:
        keys |= {k for k, v in settings.items()
                 if len(planned) < 2 or any(k not in other or other[k] != v for other in planned)}
    return keys | {f"params.{k}" for k in keys}


def trained_differently(spec: TableSpec, a: dict, b: dict) -> list[str]:
    """How the runs of two table rows were trained differently, the method aside: ['rounds 2 vs 3', ...] (empty when
    they are the same experiment but for the method, or when a row does not say how its runs were trained). A
    hyper-parameter only one of the two methods reads belongs to that method."""
    ta, tb = a.get("training"), b.get("training")
    if not isinstance(ta, dict) or not isinstance(tb, dict):
        return []
    skip = _method_keys(spec, a["method"], b["method"])
    out = []
    for k in sorted(set(ta) | set(tb)):
        if k in skip or (k.startswith("params.") and (k not in ta or k not in tb)):
            continue
        if ta.get(k) != tb.get(k):
            out.append(f"{k.removeprefix('params.').replace('_', '-')} {_shown_value(ta.get(k))} vs "
                       f"{_shown_value(tb.get(k))}")
    return out


def _spread_guess(a: dict, b: dict, metric: str) -> float | None:
    """With fewer than two seeds on one side: the spread of a per-seed difference guessed from the side that has
    seeds (sqrt(2) x its sd: two independent runs; pairing by seed usually does better), None when neither has."""
    sds = [r[f"ours_{metric}_sd"] for r in (a, b) if r[f"ours_{metric}_n"] >= 2 and r[f"ours_{metric}_sd"] is not None]
    return math.sqrt(2) * max(sds) if sds else None


def direction_checks(spec: TableSpec, table_rows: list[dict]) -> list[dict]:
    """For each (reference, compared) pair, partition and metric where we have both values: our change and the
    paper's, and a verdict, paired by seed where both sides share two or more seeds (:mod:`.paired`):

    * ``incomparable``: the two rows' runs were trained differently in anything but the method (dataset, rounds,
      a shared hyper-parameter...: ``incomparable_because``), or the two values were computed with different
      settings (model, method, samples, protocol);
    * ``too few seeds``: a side has fewer than two seeds: the only error bar would be the estimator's own, not the
      spread between seeds, so no direction is claimed (``seeds_needed``: the seeds per side that would resolve a
      change of the paper's relative size, from the other side's spread where it has seeds, else None);
    * paired (``verdict_from`` 'paired, k=K'): ``agree`` / ``disagree`` when the 95% t interval (K - 1 degrees of
      freedom) of the mean per-seed difference compared - reference excludes 0 and the mean points the paper's way
      or not; else ``inconclusive`` (also when the paper gives no value);
    * unpaired (fewer than two shared seeds): the change of the means against twice its standard error,
      sqrt(se_a^2 + se_b^2), each side's se being sd / sqrt(n) over seeds (n >= 2) or, for one seed, the
      estimator's own error; inconclusive within it or when no error is known.

    The unpaired verdict is kept beside the paired one (``unpaired_verdict``); ``seeds_needed``: for an
    inconclusive paired check, the seeds that would resolve a change of the paper's relative size at the observed
    spread (:func:`.paired.seeds_needed`). ``agrees`` keeps the bare sign comparison (None without a paper value)."""
    from .paired import paired_differences, paired_stats, seeds_needed

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
                ours = ob - oa
                paper = None if pa is None or pb is None else pb - pa
                (ua, ka), (ub, kb) = _mean_error(a, metric), _mean_error(b, metric)
                unc = math.sqrt(ua * ua + ub * ub) if ua is not None and ub is not None else None
                s_ours, s_paper = _sign(ours), _sign(paper)
                agrees = None if s_paper is None else (s_ours == s_paper)
                trained = trained_differently(spec, a, b)
                same_setting = a[f"ours_{metric}_setting"] == b[f"ours_{metric}_setting"] and \
                    not str(a[f"ours_{metric}_setting"]).startswith("mixed") and not trained
                because = ("trained differently: " + ", ".join(trained) if trained else
                           "" if same_setting else "computed with other settings: "
                           f"{a[f'ours_{metric}_setting']} vs {b[f'ours_{metric}_setting']}")
                few = min(a[f"ours_{metric}_n"], b[f"ours_{metric}_n"]) < 2
                resolved = None if unc is None else abs(ours) > 2 * unc
                if not same_setting:
                    unpaired = "incomparable"
                elif few:
                    unpaired = TOO_FEW_SEEDS
                elif agrees is None or not resolved:
                    unpaired = "inconclusive"
                else:
                    unpaired = "agree" if agrees else "disagree"
                ps = paired_stats(paired_differences(a.get(f"ours_{metric}_by_seed") or {},
                                                     b.get(f"ours_{metric}_by_seed") or {}).values())
                if ps["k"] >= 2:
                    verdict_from = f"paired, k={ps['k']}"
                    p_agrees = None if s_paper is None else _sign(ps["mean"]) == s_paper
                    if not same_setting:
                        verdict = "incomparable"
                    elif p_agrees is None or not ps["resolved"]:
                        verdict = "inconclusive"
                    else:
                        verdict = "agree" if p_agrees else "disagree"
                elif few and same_setting:
                    verdict_from, verdict = (f"none: {a[f'ours_{metric}_n']} / {b[f'ours_{metric}_n']} seeds, "
                                             "2 a side needed"), TOO_FEW_SEEDS
                else:
                    verdict_from, verdict = "unpaired (fewer than 2 shared seeds)", unpaired
                target = None if paper is None or not pa else paper / abs(pa) * abs(oa)
                needed = seeds_needed(ps["sd"], target) if verdict == "inconclusive" else \
                    seeds_needed(_spread_guess(a, b, metric), target) if verdict == TOO_FEW_SEEDS else None
                checks.append({
                    "table": spec.key, "partition": part, "reference": ref, "compared": cmp_, "metric": metric,
                    "model": a["model"] if a["model"] == b["model"] else f"{a['model']} / {b['model']}",
                    "ours_reference": oa, "ours_compared": ob, "ours_change": ours,
                    "ours_change_pct": None if not oa else 100.0 * ours / abs(oa),
                    "ours_uncertainty": unc, "uncertainty_from": f"{ka} / {kb}",
                    "resolved": resolved,
                    "paper_reference": pa, "paper_compared": pb, "paper_change": paper,
                    "paper_change_pct": None if paper is None or not pa else 100.0 * paper / abs(pa),
                    "ours_direction": {1: "higher", -1: "lower", 0: "equal"}[s_ours],
                    "paper_direction": {1: "higher", -1: "lower", 0: "equal", None: None}[s_paper],
                    "agrees": agrees, "verdict": verdict, "verdict_from": verdict_from,
                    "incomparable_because": because if verdict == "incomparable" else "",
                    "seeds_reference": a[f"ours_{metric}_n"], "seeds_compared": b[f"ours_{metric}_n"],
                    "paired_seeds": ps["k"], "paired_change": ps["mean"], "paired_sd": ps["sd"],
                    "paired_se": ps["se"], "paired_t": ps["t"], "paired_ci_low": ps["low"],
                    "paired_ci_high": ps["high"], "paired_resolved": ps["resolved"], "unpaired_verdict": unpaired,
                    "paper_size_change": target, "seeds_needed": needed,
                })
    return checks


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
