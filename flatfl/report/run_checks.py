"""Whether a run's results belong to it: every result of a finished run checked against the weights it names, the
runs of one report checked for copies, and the flatfl / torch versions each result was made with."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError
from .run_reader import MODELS, RECOMPUTE_HINT, analysis_model, measured_round

__all__ = ["check_provenance", "recorded_versions", "check_runs_belong_together", "version_notices"]


def check_provenance(d: Path, cfg: dict, rounds_done: int, analyses: dict, clients_all: dict, *,
                     network: dict | None = None, data: dict | None = None) -> dict:
    """Every result of a finished run checked against the run it sits in (one ConfigError line naming both
    digests otherwise): config.json's training settings are final.pt's (a hand-edited config.json would file the
    run under another algorithm), its record of a network of the user's (``network``: class, factory, structure)
    is final.pt's, so is its record of data of the user's (``data``: name and digest), metrics.csv reaches final.pt's round (a truncated one would pair an early accuracy with a later
    Hessian), and each hessian.json, clients-*.json and surface.json measured the weights of the model it names
    (not another run's, copied in). Returns {'server': digest, 'clients-average': digest}."""
    from ..analysis.commands.result_files import read_surface_file
    from ..checkpoint import read_checkpoint
    from ..run_layout import MODEL_CHECKPOINTS, analysis_dir
    from ..utils.provenance import differing_settings, settings_digest, short, state_digest

    final = d / MODEL_CHECKPOINTS["server"]
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
    from ..train.identity import data_identity, network_identity
    from .experiments import shown_repr

    for what, ours, theirs in (("network", network_identity(network), network_identity(payload.get("model_spec"))),
                               ("data", data_identity(data), data_identity(payload.get("dataset")))):
        edited = [k for k in ours if k in theirs and ours[k] != theirs[k] and theirs[k] is not None]
        if edited:
            shown = ", ".join(f"{k} {shown_repr(ours[k])} (final.pt: {shown_repr(theirs[k])})" for k in edited)
            raise ConfigError(f"{d / 'config.json'} does not describe the {what} of final.pt ({shown}): it was "
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


def recorded_versions(d: Path, analyses: dict, clients_all: dict) -> dict:
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
    """Refuse two runs holding the same final weights unless they are two runs of one seed of one experiment (the
    same seed and experiment settings: trained again with tracking, client checkpoints or other settings that
    change no number; a table keeps one of them). Anything else is a copy of one run that would count as a second
    seed, or as a run of another experiment, and shrink the standard error."""
    from ..utils.provenance import short
    from .experiments import run_identity

    seen: dict = {}
    for r in records:
        digest = getattr(r, "weights_sha256", None)
        if digest is None:
            continue
        first = seen.setdefault(digest, r)
        if first is r:
            continue
        identity = run_identity(r)
        if not (getattr(first, "seed", None) == getattr(r, "seed", None) and identity is not None
                and identity == run_identity(first)):
            raise ConfigError(f"{first.run_dir} and {r.run_dir} hold the same final weights (sha256 "
                              f"{short(digest)}): one is a copy of the other and would count as a second seed; "
                              "report only one of them")


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
