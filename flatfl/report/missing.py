"""What the report needs of each run and does not have (a Hessian of the run's model with the settings asked for;
H_N / H_D where a layout has a cross-client column, :func:`.metrics.clients_needed`), computed with
``--compute-missing`` or listed; and the notices on the analyses used (one H_N / H_D protocol per column, sample
counts larger than the split)."""
from __future__ import annotations

import time

from ..errors import FlatflError
from ..analysis.commands.hessian_settings import HessianSettings
from .layouts import fills, records_of
from .metrics import clients_needed
from .records import choose_clients_protocol
from .run_reader import MODEL_NAMES

__all__ = ["DEFAULT_HESSIAN", "DEFAULT_CLIENTS", "needs", "settings_ok", "compute_missing", "pick_clients",
           "sample_notices", "missing_lines"]

# a density asked of --compute-missing averages 4 SLQ starts of 100 Lanczos steps (one start is spiky)
DEFAULT_HESSIAN = dict({k: v for k, v in HessianSettings().to_dict().items()
                        if k in ("top", "trace", "density", "samples", "method", "seed")}, density_starts=4)
DEFAULT_CLIENTS = {"protocol": "default", "probes": 100, "seed": 0}


def needs(rec, specs, asked: dict | None = None) -> list[str]:
    """What the report needs from this run and does not have: 'hessian', 'clients'. A Hessian needs its top
    eigenvalues unless ``asked`` (the Hessian settings asked for) says ``top`` 0, and its trace."""
    need = []
    h = rec.hessian or {}
    has_trace = (h.get("trace") or {}).get("estimate") is not None
    wants_top = (asked or {}).get("top") != 0
    if not h or (wants_top and not h.get("top_eigenvalues")) or not has_trace:
        need.append("hessian")
    wants_clients = any(clients_needed(s) and fills(s, rec) for s in specs)
    if wants_clients and (rec.clients or {}).get("H_N") is None:
        need.append("clients")
    return need


def _folder_tag(asked: dict) -> str:
    parts = []
    for k, v in sorted(asked.items()):
        if k in ("device", "quiet", "data_dir"):
            continue
        parts.append(k if v is True else f"no{k}" if v is False else f"{k}{v if v is not None else 'all'}")
    return "-".join(parts).replace("_", "").replace(".", "p") or "default"


def settings_ok(asked: dict):
    """A test of a hessian.json's settings against the asked ones (and of the default split and loss, which the
    report cannot ask otherwise); None when nothing is asked."""
    from ..run_layout import settings_match
    from .records import measures_defaults

    if not asked:
        return None
    return lambda h: settings_match(h.get("settings"), asked) and measures_defaults(h)


def _analysis_folder(rec, asked: dict, need: list[str]) -> tuple[str, list[str]]:
    """The folder the run's missing Hessian goes into, and the existing analysis with other settings it avoids."""
    from ..run_layout import analysis_dir

    folder = analysis_dir("hessian", rec.model)
    if folder in rec.stale:  # it measured an earlier round: kept where it is, the final model's goes beside it
        folder = f"{folder}-round{rec.config.get('rounds')}"
    other = [n for n in rec.analyses if n == folder]
    if "hessian" in need and other:
        folder = f"{folder}-{_folder_tag(asked)}"  # never overwrite (nor silently keep) other settings
    return folder, other


def compute_missing(records, specs, hessian: dict, asked: dict, clients: dict, echo) -> tuple[list, list]:
    """Compute, for every run, what the report lacks: a Hessian of the run's model with the settings asked for
    (``asked``: the options the user gave; an analysis made with other settings is kept where it is and the asked
    one is computed into a folder of its own), and H_N / H_D. Returns (problems, what was done)."""
    from ..run_layout import analyse_run

    problems, done = [], []
    for rec in records:
        need = needs(rec, specs, asked)
        if not need or not rec.finished:  # a run not finished is listed by missing_lines
            continue
        if "clients" in need and not (rec.run_dir / "clients.pt").is_file():
            problems.append(f"{rec.name}: H_N / H_D need the clients' models; train with --save-clients")
            need.remove("clients")
        if not need:
            continue
        folder, other = _analysis_folder(rec, asked, need)
        t0 = time.perf_counter()
        try:
            analyse_run(rec.run_dir, hessian=hessian if "hessian" in need else None,
                        clients=clients if "clients" in need else None, model=rec.model, hessian_dir=folder)
        except FlatflError as e:
            problems.append(f"{rec.name}: {e}")
            continue
        what = []
        if "hessian" in need:
            what.append(f"the Hessian of the {MODEL_NAMES[rec.model]} model into {folder}/"
                        + (f" (the analysis in {other[0]}/ has other settings and is kept)" if other else ""))
        if "clients" in need:
            what.append("H_N / H_D")
        line = f"computed for {rec.name}: {', '.join(what)} ({time.perf_counter() - t0:.1f} s)"
        done.append(line)
        if echo:
            echo(line)
    return problems, done


def pick_clients(records, specs) -> list[str]:
    """Make every layout's H_N / H_D column one protocol where its runs allow it (:func:`choose_clients_protocol`);
    returns a notice for each layout whose runs hold results of more than one protocol (which one is shown)."""
    out = []
    for spec in specs:
        if not clients_needed(spec):
            continue
        recs = records_of(spec, records)
        proto = choose_clients_protocol(recs)
        for r in recs:
            r.select_clients(proto)
        held = sorted({p for r in recs for p in r.clients_all})
        if len(held) > 1:
            used = sorted({(r.clients or {}).get("protocol", "?") for r in recs if r.clients})
            out.append(f"{spec.key}: the runs hold H_N / H_D of the {' and '.join(held)} protocols; the table shows "
                       f"the {' / '.join(used)} protocol's (each protocol's results: clients-<protocol>.json)")
    return out


def sample_notices(records) -> list[str]:
    """A notice for every Hessian whose asked sample count exceeded the split (it used the whole split)."""
    out = []
    for rec in records:
        h = rec.hessian or {}
        asked = (h.get("settings") or {}).get("samples")
        used = h.get("num_samples")
        if asked is not None and used is not None and int(asked) > int(used):
            out.append(f"{rec.name}: {int(asked):,} samples asked for the Hessian, the split has {int(used):,}: "
                       f"all {int(used):,} used (the tables show the samples actually used)")
    return out


def _missing_line(rec, specs, asked: dict) -> str | None:
    if not rec.finished:
        return (f"{rec.name}: not finished ({rec.rounds_done}/{rec.config.get('rounds')} rounds): left out of every "
                f"table column; resume it with flatfl train --resume {rec.run_dir}")
    need = needs(rec, specs, asked)
    if not need:
        return None
    what = " and ".join({"hessian": f"Hessian results of the {MODEL_NAMES[rec.model]} model"
                                    + (" with the asked settings" if asked else ""),
                         "clients": "H_N / H_D"}[n] for n in need)
    stale = "".join(f"; {n}/ measured round {r}, the run's last round is {rec.config.get('rounds')}"
                    for n, r in sorted(rec.stale.items()))
    return f"{rec.name}: no {what}{stale}"


def missing_lines(records, specs, asked: dict, problems: list[str], computing: bool) -> list[str]:
    """The report's 'Missing' list: runs not finished, results still missing, what could not be computed, and
    (without ``computing``) how to compute them."""
    missing = [line for line in (_missing_line(rec, specs, asked) for rec in records) if line]
    missing += [p for p in problems if p not in missing]
    if missing and not computing:
        missing.append("run 'flatfl report ... --compute-missing' to compute the missing analyses")
    return missing
