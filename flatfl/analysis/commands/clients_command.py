"""What ``flatfl hessian-clients`` does: a run saved with ``--save-clients`` in; ``clients-<protocol>.json`` and
``clients_heatmap-<protocol>.png/.pdf`` out (:mod:`flatfl.analysis.commands.skeleton`'s skeleton; the estimator:
:func:`flatfl.analysis.estimators.client_metrics.cross_client_metrics`; settings:
:class:`~flatfl.analysis.commands.client_metrics_settings.ClientMetricsSettings`; the file read back:
:func:`flatfl.analysis.commands.result_files.read_clients_file`)."""
from __future__ import annotations

import functools

from ...errors import CheckpointError, ConfigError
from ...utils import ranks
from .client_metrics_settings import ClientMetricsSettings
from ...utils.lock import locks_output
from ..estimators.client_metrics import FEDALIGN_BATCH, FEDALIGN_SAMPLES, cross_client_metrics
from .skeleton import AnalysisCommand, progress_bar, versions, weights_digest
from .result_figures import clients_heatmap
from .result_files import clients_file, read_clients_file, read_hessian_file

__all__ = ["run_client_metrics", "clients_file"]



@locks_output
def run_client_metrics(checkpoint, out, settings: ClientMetricsSettings = ClientMetricsSettings(), *,
                       quiet: bool = False, replace: bool = False) -> dict:
    """What ``flatfl hessian-clients`` does: a run saved with ``--save-clients`` in; ``clients-<protocol>.json`` and
    ``clients_heatmap-<protocol>.png/.pdf`` out (every file atomic; nothing written on bad input). ``settings``: what
    is computed and where (:class:`~flatfl.analysis.commands.client_metrics_settings.ClientMetricsSettings`).

    Each protocol has files of its own, so the two protocols' results live side by side in one folder. Results of
    the same protocol with other settings (probes, groups, samples, batch size, seed, tol) already in ``out`` are
    never replaced silently: a :class:`ConfigError` names them, unless ``replace`` (a sweep re-running with its
    grid's new settings). An ``out/hessian.json`` of another checkpoint is refused as before."""
    s = settings.validate()
    heatmap = clients_file(s.protocol, "heatmap", s.curvature)
    target_name = clients_file(s.protocol, curvature=s.curvature)
    cmd = AnalysisCommand.open(checkpoint, out, device=s.device, outputs=[target_name, f"{heatmap}.png",
                                                                          f"{heatmap}.pdf"],
                               data_dir=s.data_dir, model_factory=s.model_factory, precision=s.precision)
    out, ckpt = cmd.out, cmd.checkpoint
    _check_hessian_report(out / "hessian.json", ckpt)  # a folder of another checkpoint is refused
    target = out / target_name
    existing = read_clients_file(target)
    state = ckpt.client_state()  # CheckpointError when the run was trained without --save-clients
    # over several ranks: every rank read the same data and the same server and client models (a rank given other
    # files would mix its clients' numbers into the others'); nothing computed in one process
    ranks.agree(lambda: {"training data": ranks.digest(ckpt.dataset().train_x, ckpt.dataset().train_y),
                         "weights": ranks.fingerprint(None, list(ckpt.model.state_dict().values())),
                         "client models": ranks.fingerprint(None, [state["params"]])})
    num_clients = int(state["params"].shape[0])
    if num_clients < 2:
        raise CheckpointError(f"{ckpt.path}: the run has {num_clients} client model(s); H_N and H_D need 2 or more")

    from ..operators.curvatures import curvature_operator

    if s.protocol == "default":
        batch = s.batch_size or 256
        sizes = ckpt.partition.sizes
        clients = [k for k in range(num_clients) if sizes[k] > 0]
        if len(clients) < 2:
            raise CheckpointError(f"{ckpt.path}: fewer than 2 clients hold data")
        factories = [(lambda k=k: curvature_operator(s.curvature, ckpt.model,
                                                     ckpt.client_batches(k, batch_size=batch, samples=s.samples,
                                                                         seed=s.seed)))
                     for k in clients]
        held = [int(sizes[k]) for k in clients]
        used = [min(int(s.samples), n) for n in held] if s.samples else held
        drawn = (f"{min(used)}-{max(used)}" if min(used) != max(used) else f"{used[0]}")
        data = ("each client's own training data"
                + (f" ({drawn} samples a client: {s.samples} asked, drawn once per client with seed {s.seed}"
                   f"{', all of a client that holds fewer' if min(held) < int(s.samples) else ''})" if s.samples
                   else " (all of it)")
                + ", no augmentation")
        model_used = "global (server) model"
        deviations = []
    else:
        batch = s.batch_size or FEDALIGN_BATCH
        count = s.samples or FEDALIGN_SAMPLES
        clients = list(range(num_clients))
        shared = ckpt.eval_batches("train", samples=count, batch_size=batch, seed=s.seed)
        factories = [(lambda k=k: curvature_operator(s.curvature, ckpt.client_model(k, state), shared))
                     for k in clients]
        data = (f"the global training set: {min(count, sum(len(y) for _, y in shared))} samples drawn once with "
                f"seed {s.seed}, batches of {batch}, no augmentation")
        model_used = "each client's latest local model"
        deviations = ["FedAlign's loader applied training augmentation and reshuffled the training set for every "
                      "Hessian-vector product; here the samples are drawn once and not augmented (a fixed operator)",
                      "FedAlign's probes came from torch's global CUDA generator after set_random_seed(1); here "
                      f"from a CPU torch.Generator seeded with {s.seed}, the same for every client as in FedAlign"]

    record = {"protocol": s.protocol, "probes": s.probes, "groups": s.groups, "samples": s.samples,
              "batch_size": batch, "seed": s.seed, "tol": s.tol if s.protocol == "fedalign" else None,
              "device": str(cmd.device),
              **({"precision": ckpt.precision} if ckpt.precision != "float32" else {})}  # float32: as always
    if s.curvature != "hessian":  # recorded when it is not the Hessian (the files of a Hessian are as they were)
        record["curvature"] = s.curvature
    digest = weights_digest(ckpt.model)
    if existing is not None:  # refused before any work
        if existing.get("weights_sha256") not in (None, digest):
            raise ConfigError(f"{target} holds results of other weights than {ckpt.path}; choose another --out")
        changed = changed_settings(existing.get("settings"), record)
        if changed and not replace:
            raise ConfigError(f"{target} holds {s.protocol}-protocol results made with {changed}; choose another "
                              "--out (or delete that file) to keep both")

    with progress_bar(quiet, total=len(factories), desc="clients", unit="client") as bar:
        metrics = cross_client_metrics(factories, protocol=s.protocol, probes=s.probes, groups=s.groups,
                                       seed=s.seed, tol=s.tol, progress=lambda k: bar.update(1), spread=cmd.world)

    section = metrics.as_dict()
    section.update({
        "clients": clients,
        "model": model_used,
        "data": data,
        "mode": "eval",
        "deviations_from_fedalign_code": deviations if s.protocol == "fedalign" else None,
        "settings": record,
    })
    on = (f"{s.samples} samples a client" if s.samples else "all of each client's data") \
        if s.protocol == "default" else f"{min(count, sum(len(y) for _, y in shared))} shared training samples"
    names = [f"{heatmap}.{fmt}" for fmt in ("pdf", "png")]
    report = dict(section, **cmd.header(digest=digest, network_key="network"), distributed=ranks.record(),
                  **versions(), files=names + [target.name])
    cmd.write({name: functools.partial(clients_heatmap, metrics, cmd.title, name.rsplit(".", 1)[1], data=on,
                                       curvature=s.curvature) for name in names},
              target.name, report)  # every rank holds the same metrics; the writing rank alone draws and writes
    return report


# settings that change no number: where it ran
NEUTRAL_SETTINGS = ("device",)


def changed_settings(old, new: dict) -> str:
    """'probes 100 (now 20), samples all (now 64)': the settings of ``old`` that differ from ``new``; '' if none."""
    old = old if isinstance(old, dict) else {}
    diffs = []
    for key in sorted(set(old) | set(new)):
        if key in NEUTRAL_SETTINGS or old.get(key) == new.get(key):
            continue

        def show(v):
            return "all" if v is None and key == "samples" else str(v)

        diffs.append(f"{key} {show(old.get(key))} (now {show(new.get(key))})")
    return ", ".join(diffs)


def _check_hessian_report(path, ckpt) -> None:
    """A ``hessian.json`` already in ``--out`` must be a flatfl result of this checkpoint (or carry a digest)."""
    report = read_hessian_file(path)
    if report is not None and report.get("checkpoint") not in (None, str(ckpt.path)) and not report.get("weights_sha256"):
        raise ConfigError(f"{path} belongs to checkpoint {report['checkpoint']}, not {ckpt.path}; "
                          "choose another --out")
