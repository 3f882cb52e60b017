"""The checkpoint format: where training and analysis meet (training writes it, analysis reads it; neither imports
the other). One writer, :func:`save_checkpoint`; one reader, :func:`load_checkpoint` (``flatfl.load_checkpoint``).

A model checkpoint (``final.pt``, ``checkpoints/round_XXXX.pt``) is a dict of tensors and plain values, loadable
with ``torch.load(weights_only=True)``. It holds everything needed to rebuild the model and its data without the
original command line and without the code of the run's algorithm or regularizer: the model's full architecture
(``model_spec``, :mod:`flatfl.models.model_spec`: registry name and arguments, projection head, residual-block survival),
the weights of the server model and of the average of all clients' latest models, the dataset name and directory,
the partition, the resolved config, the round, the metrics so far, the RNG states and the flatfl version.

Format versions: 2 stores the full architecture in ``model_spec``. Version 1 (flatfl 0.1.0 before the layering)
recorded the projection head and stochastic depth only through the run's algorithm and regularizer;
:func:`legacy_model_spec` completes such a spec from the resolved settings it saved.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from .errors import CheckpointError, ConfigError
from .models.model_spec import model_from_spec
from .utils.device import resolve_device
from .utils.io import atomic_torch_save
from .utils.precision import check_precision, computing_in, torch_dtype
from .utils.provenance import is_settings_digest, json_digest, settings_digest, short, state_digest
from .utils.torch_files import PLAIN_PICKLE, check_nesting, load_weights_only, plain_pickle

FORMAT = "flatfl-checkpoint"
FORMAT_VERSION = 2
REQUIRED_KEYS = ("model_spec", "state_dict", "dataset", "config", "round")
FINAL_FILE = "final.pt"  # a finished run's server model
CLIENTS_AVERAGE_FILE = "final-clients-average.pt"  # the average of all clients' latest models of a finished run


def save_checkpoint(path: str | Path, payload: dict) -> None:
    """Write a model checkpoint atomically, with the format header and its provenance record: the digests of its
    weights (``weights_sha256``), of its model spec (``model_spec_sha256``) and of the run's training settings
    (``run_settings_sha256``), and the torch version (``flatfl_version`` is the writer's)."""
    payload = dict(payload, format=FORMAT, format_version=FORMAT_VERSION,
                   weights_sha256=state_digest(payload["state_dict"]), model_spec_sha256=json_digest(payload["model_spec"]),
                   run_settings_sha256=settings_digest(payload.get("config") or {}), torch_version=str(torch.__version__))
    atomic_torch_save(payload, path)


def save_clients_average(run_dir: str | Path, payload: dict) -> Path:
    """Write ``RUN/final-clients-average.pt`` from a final checkpoint's payload: the average of all clients'
    latest models (MAN's and FedDyn's reported model) as a checkpoint of its own, so analyses can take either
    model. For algorithms where it equals the server model it is still written, and says so (``equals_server``)."""
    equal = all(torch.equal(payload["state_dict"][k], payload["all_state_dict"][k]) for k in payload["state_dict"])
    path = Path(run_dir) / CLIENTS_AVERAGE_FILE
    save_checkpoint(path, dict(payload, state_dict=payload["all_state_dict"], model_role="clients-average",
                               equals_server=equal))
    return path


#: a custom dataset saved with its run (``flatfl.data.datasets.dataset_payload``, tensors only)
CUSTOM_DATA_FILE = "data.pt"
CHECKPOINTS_DIR = "checkpoints"  # a run's round checkpoints: RUN/checkpoints/round_XXXX.pt
_DATA_TENSORS = ("train_x", "train_y", "test_x", "test_y")


def own_data_sha256(payload) -> str:
    """sha256 of a custom dataset as ``data.pt`` holds it (:func:`flatfl.data.datasets.dataset_payload`): its four
    tensors, then its other fields but the name and class names, as JSON. A run records it as its dataset's
    ``sha256`` in ``config.json`` and in every checkpoint when it saves ``data.pt``; the same value
    ``flatfl.report.records.own_data_digest`` computes from the file."""
    tensors = {k: payload[k] for k in _DATA_TENSORS}
    rest = {k: v for k, v in payload.items() if k not in _DATA_TENSORS and k not in ("name", "class_names")}
    return json_digest([state_digest(tensors), rest])


def dataset_sha256(ds) -> str:
    """:func:`own_data_sha256` of an :class:`~flatfl.data.ImageDataset` (as it would be saved in ``data.pt``)."""
    from .data.datasets import dataset_payload

    return own_data_sha256(dataset_payload(ds))


def run_data_file(checkpoint_path: str | Path, file_name: str = CUSTOM_DATA_FILE) -> Path:
    """Where the run a checkpoint belongs to keeps its ``data.pt``: beside ``final.pt`` (the run folder), or for a
    round checkpoint in ``RUN/checkpoints/`` in the run folder above. Never a parent folder's otherwise: a run
    without its own ``data.pt`` is missing it, whatever a folder above holds."""
    checkpoint_path = Path(checkpoint_path)
    here = checkpoint_path.parent
    name = Path(str(file_name)).name  # a recorded file name, never a path elsewhere
    if here.name == CHECKPOINTS_DIR and checkpoint_path.name.startswith("round_"):
        return here.parent / name
    return here / name


def load_run_data(path: str | Path, recorded_sha256: str | None, whose: str | Path):
    """Read a run's saved custom dataset (``data.pt``, :func:`flatfl.data.datasets.load_saved_dataset`) and check it
    is that run's: its :func:`own_data_sha256` against ``recorded_sha256`` (what the run recorded when it wrote the
    file; None for a run made before the digest was recorded: not checked). A missing file or another run's data is
    one CheckpointError line naming ``whose`` (the checkpoint or run) and both digests."""
    from .data.datasets import load_saved_dataset

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{whose}: the run's saved data {path} is missing (a custom dataset is analysed with "
                              "the data.pt its run wrote)")
    ds = load_saved_dataset(path)
    if isinstance(recorded_sha256, str):
        found = dataset_sha256(ds)
        if found != recorded_sha256:
            raise CheckpointError(f"{path} is not the data {whose} was trained on (its sha256 {short(found)}, the run "
                                  f"recorded {short(recorded_sha256)}): another run's data.pt; restore the run's own")
    return ds


def refused_objects(error: BaseException) -> bool:
    """Whether ``torch.load(weights_only=True)`` failed because the file names Python objects (classes, functions:
    what a pickle would import and run), as opposed to bytes that are no pickle at all."""
    return "Unsupported global" in str(error) or "GLOBAL" in str(error)


# version 1: what MOON's wrap_model and StochDepth's prepare_model did to the network: (the piece's name, its
# setting in 'resolved', the same setting's key in the config's params, the default then)
LEGACY_PROJECTION = ("moon", "proj_dim", "moon_proj_dim", 256)
LEGACY_SURVIVAL = ("stochdepth", "survival_last", "survival_last", 0.9)


def legacy_model_spec(payload: dict) -> dict:
    """A version-1 checkpoint's model spec completed with the architecture changes its algorithm and regularizer
    made (MOON's projection head, stochastic depth's survival), read from the settings it saved."""
    spec = dict(payload["model_spec"])
    config = payload.get("config") or {}
    resolved = payload.get("resolved") or {}
    params = config.get("params") or {}

    def setting(section: str, piece: str, key: str, flag: str, default):
        chosen = resolved.get(section) or {}
        name = chosen.get("name", config.get("algo" if section == "algorithm" else "reg"))
        if name != piece:
            return None
        return chosen.get(key, params.get(flag, default))

    head = setting("algorithm", *LEGACY_PROJECTION)
    if head is not None and "projection_head" not in spec:
        spec["projection_head"] = int(head)
    last = setting("regularizer", *LEGACY_SURVIVAL)
    if last is not None and "survival" not in spec:
        spec["survival_last"] = float(last)
    return spec


# settings a piece records in 'resolved' under a name it has since changed: (section, piece) -> {old: current}.
# Read one way: an old file's name is taken as the current one; files are written with the current name only.
RENAMED_SETTINGS = {("algorithm", "fedspeed"): {"alpha": "lam"}}  # FedSpeed's lambda, stored as alpha before


def current_setting_names(resolved: dict) -> dict:
    """A checkpoint's (or run config's) ``resolved`` settings with every renamed setting
    (:data:`RENAMED_SETTINGS`) under its current name; anything else as it was."""
    out = dict(resolved)
    for (section, piece), renames in RENAMED_SETTINGS.items():
        chosen = out.get(section)
        if isinstance(chosen, dict) and chosen.get("name") == piece and any(old in chosen for old in renames):
            out[section] = {renames.get(k, k): v for k, v in chosen.items() if k not in renames or renames[k] not in chosen}
    return out


def short_reason(error: BaseException, limit: int = 160) -> str:
    """An exception's message as one short clause: its first line, cut at a word before ``limit`` characters."""
    text = str(error).strip()
    reason = text.splitlines()[0].strip() if text else type(error).__name__
    if len(reason) > limit:
        reason = reason[:limit].rsplit(" ", 1)[0].rstrip(" ,;:(") + " ..."
    return reason


def load_tensors(path: Path, what: str):
    """A file of tensors flatfl wrote (``torch.load(weights_only=True)``: no code executed), or one
    :class:`CheckpointError` line naming ``what``."""
    if not path.is_file():  # a pipe would block the read forever, a device never ends
        raise CheckpointError(f"{path} is not a regular file, not a {what}")
    try:
        payload = load_weights_only(path)
    except Exception:
        if plain_pickle(path):
            raise CheckpointError(f"{path} is not a {what} ({PLAIN_PICKLE})") from None
        raise CheckpointError(f"{path} is not a readable {what} (corrupt or truncated)") from None
    check_nesting(payload, path)
    return payload


def read_checkpoint(path: str | Path) -> dict:
    """The validated payload of a checkpoint file (no code executed: ``weights_only=True``); a format-1 model spec
    is completed (:func:`legacy_model_spec`)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a checkpoint (no final.pt in it)")
    if not path.is_file():  # a pipe would block the read forever, a device never ends
        raise CheckpointError(f"{path} is not a regular file (a pipe, device or socket), not a checkpoint")
    try:
        payload = load_weights_only(path)
    except Exception as e:  # truncated zip, pickle garbage, a text file...
        if plain_pickle(path):
            raise CheckpointError(f"{path} is not a flatfl checkpoint ({PLAIN_PICKLE})") from None
        if refused_objects(e):
            raise CheckpointError(f"{path} holds Python objects that flatfl will not load (unpickling them could run "
                                  "code): not a flatfl checkpoint, or tampered with") from None
        reason = short_reason(e) if "weights_only" not in str(e) else "refused by the weights-only reader"
        raise CheckpointError(f"{path} is not a readable flatfl checkpoint (corrupt or truncated: {reason})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a flatfl checkpoint (no flatfl header)")
    check_nesting(payload, path)  # before anything walks it (a list shared at every level never ends)
    version = payload.get("format_version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise CheckpointError(f"{path} is a damaged flatfl checkpoint (its format_version is {version!r}, "
                              "not a whole number)")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path} was written by a newer flatfl (format {version})")
    missing = [k for k in REQUIRED_KEYS if k not in payload]
    if missing:
        raise CheckpointError(f"{path} is an incomplete flatfl checkpoint (missing {', '.join(missing)})")
    for key in ("state_dict", "all_state_dict"):
        sd = payload.get(key)
        if key == "state_dict" and not isinstance(sd, dict):
            raise CheckpointError(f"{path} is an incomplete flatfl checkpoint ({key} is not a table of tensors)")
        if isinstance(sd, dict):
            bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)
                   or (v.is_floating_point() and not torch.isfinite(v).all())]
            if bad:
                raise CheckpointError(f"{path} holds non-finite or non-tensor weights ({key}: {bad[0]})")
    if not isinstance(payload["config"], dict) or not isinstance(payload["model_spec"], dict) \
            or not isinstance(payload["dataset"], dict) or not isinstance(payload["round"], int):
        raise CheckpointError(f"{path} is an incomplete flatfl checkpoint (config, model_spec, dataset or round malformed)")
    check_provenance(payload, path)
    if isinstance(payload.get("resolved"), dict):
        payload = dict(payload, resolved=current_setting_names(payload["resolved"]))
    if payload.get("format_version", 0) < 2:
        try:
            payload = dict(payload, model_spec=legacy_model_spec(payload))
        except (TypeError, ValueError, AttributeError):
            raise CheckpointError(f"{path} is a format-1 checkpoint with malformed algorithm or regularizer "
                                  "settings (config, resolved)") from None
    return payload


def check_provenance(payload: dict, path) -> None:
    """The checkpoint is what its record says: in checkpoints that record them, the digests of its spec
    and weights match its contents; in older files, the spec names the network the run's config asked for. A spec edited to name another architecture with the same parameter shapes is refused here, before
    the network is built from it."""
    spec, config = payload["model_spec"], payload["config"]
    name, trained = spec.get("name"), config.get("model")
    recorded = payload.get("model_spec_sha256")
    # files without a spec digest (older flatfl): the spec must name the network the config asked for
    if not isinstance(recorded, str) and name != "custom" and isinstance(trained, str) and trained != "custom" \
            and name != trained:
        raise CheckpointError(f"{path}: its model_spec names {name!r} but the run trained {trained!r}; the spec "
                              "was edited, and the weights would be analysed as another network")
    if isinstance(recorded, str) and recorded != json_digest(spec):
        raise CheckpointError(f"{path}: its model_spec was changed after training (sha256 {short(json_digest(spec))}, "
                              f"recorded {short(recorded)}); the weights would be analysed as another network")
    recorded = payload.get("weights_sha256")
    if isinstance(recorded, str) and recorded != state_digest(payload["state_dict"]):
        raise CheckpointError(f"{path}: its weights were changed after training (sha256 "
                              f"{short(state_digest(payload['state_dict']))}, recorded {short(recorded)})")
    check_clients_average(payload, path)


def check_clients_average(payload: dict, path) -> None:
    """A clients-average checkpoint (``final-clients-average.pt``) holds the all-clients average of the ``final.pt``
    beside it: another run's copied in is refused, naming both digests, before it is measured as this run's."""
    path = Path(path)
    final = path.parent / FINAL_FILE
    if payload.get("model_role") != "clients-average" or path.name == FINAL_FILE or not final.is_file():
        return
    try:
        average = load_weights_only(final).get("all_state_dict")
    except Exception:  # final.pt's own problems are named when it is read
        return
    if not isinstance(average, dict) or not all(isinstance(v, torch.Tensor) for v in average.values()):
        return
    have, want = state_digest(payload["state_dict"]), state_digest(average)
    if have != want:
        raise CheckpointError(f"{path} is not the all-clients average of {final} (its weights sha256 {short(have)}, "
                              f"final.pt's average {short(want)}): another run's, copied in; delete it and flatfl "
                              "writes it again from final.pt")


def check_spec_size(spec: dict, state: dict, path) -> None:
    """The network ``spec`` describes holds as many values as the checkpoint's weights: built on torch's 'meta'
    device first (shapes, no memory), so a small file whose spec asks for huge layers is refused before anything is
    allocated. A spec that does not build is left to the real build, which names the problem."""
    have = sum(t.numel() for t in state.values() if isinstance(t, torch.Tensor))
    try:
        with torch.device("meta"):
            probe = model_from_spec(spec)
    except Exception:
        return
    need = sum(t.numel() for t in probe.state_dict().values())
    if need != have:
        raise CheckpointError(f"{path}: weights do not fit model {spec.get('name')!r}: its model_spec describes "
                              f"{need:,} values, the checkpoint holds {have:,} (refused before building it)")


def same_network(recorded, model: nn.Module, what: str, path, factory=None):
    """Whether your network is the one the checkpoint trained, as far as its recorded structure tells (checkpoints
    of older flatfl record none and pass): None, or a function that says it, to call once the weights are loaded
    (other modules, settings or values: a CheckpointError; changed code of yours, ``factory``'s included: a notice
    on stderr, as a comment or a refactoring changes it too). A network already wrapped in its projection head is not compared (the
    structure is taken before the wrapping)."""
    from .models.projection import ProjectionHeadModel
    from .models.structure import code_changes, structure_difference

    if recorded is None or isinstance(model, ProjectionHeadModel):
        return None
    differs = structure_difference(recorded, model)
    if differs:
        def refuse():
            raise CheckpointError(f"{path}: {what} builds another network than the one trained ({differs}); the "
                                  "weights would be analysed as another network: use the network the run was "
                                  "trained with")

        return refuse
    if isinstance(factory, str):  # imported already, to build the network
        from .models.factory import import_function

        factory = import_function(factory)
    changed = code_changes(recorded, model, factory)
    if changed:
        def notice():
            import sys

            print(f"notice: the code of {', '.join(changed)} changed since {path} was trained; its weights are "
                  "analysed with the code as it is now", file=sys.stderr, flush=True)

        return notice
    return None


def factory_network(model_factory: str, seed) -> nn.Module:
    """The network ``model_factory`` builds, called after ``torch.manual_seed(seed)`` (the run's seed) as training
    called it, so that what it draws at random (a non-persistent buffer no checkpoint holds) is drawn again alike;
    the caller's random state is kept."""
    from .models.factory import model_from_factory

    with torch.random.fork_rng(devices=[]):
        if isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2 ** 63:
            torch.manual_seed(seed)
        return model_from_factory(model_factory)


def resolve_checkpoint_path(path: str | Path) -> Path:
    """A checkpoint file, or a run directory (its final.pt, else its latest round checkpoint)."""
    p = Path(path)
    if p.is_dir():
        if (p / "final.pt").is_file():
            return p / "final.pt"
        rounds = sorted((p / "checkpoints").glob("round_*.pt")) if (p / "checkpoints").is_dir() else []
        if rounds:
            return rounds[-1]
        raise CheckpointError(f"{p} is a directory with no final.pt or checkpoints/round_*.pt: not a flatfl run")
    return p


class Checkpoint:
    """A loaded checkpoint: the model (weights loaded, eval mode) and deterministic access to its data.

    >>> ckpt = flatfl.load_checkpoint("runs/x/final.pt")
    >>> ckpt.model, ckpt.num_params, ckpt.round
    >>> batches = ckpt.eval_batches("train", samples=512, batch_size=128, seed=0)
    """

    def __init__(self, payload: dict, path: Path, device: str | torch.device = "cpu", which: str = "server",
                 data_dir: str | Path | None = None, model: nn.Module | None = None, model_factory: str | None = None,
                 precision: str | None = None):
        """``precision``: the floating type the model and its batches are held in, ``float32`` or ``float64``;
        default the run's (:func:`saved_precision`), so that an analysis of a float64 run computes in float64."""
        self.path = Path(path)
        self.payload = payload
        self.device = resolve_device(device)
        self.config: dict = payload["config"]
        self.round: int = int(payload["round"])
        self.metrics: list[dict] = payload.get("metrics", [])
        self.model_spec: dict = payload["model_spec"]
        self.dataset_name: str = payload["dataset"]["name"]
        self.data_dir = Path(data_dir) if data_dir is not None else Path(payload["dataset"].get("data_dir") or "data")
        self.flatfl_version: str = payload.get("flatfl_version", "?")
        self.which = which
        key = {"server": "state_dict", "all": "all_state_dict"}.get(which)
        if key is None or key not in payload:
            raise CheckpointError(f"{path} has no {which!r} model (choose 'server' or 'all')")
        self.precision: str = check_precision(precision) if precision is not None else saved_precision(payload[key])
        with computing_in(self.precision):  # a network built here is built in that type
            model = self._network(payload, path, key, model, model_factory)
        self.model: nn.Module = model.to(device=self.device, dtype=torch_dtype(self.precision)).eval()
        self._dataset = None

    def _network(self, payload: dict, path: Path, key: str, model, model_factory) -> nn.Module:
        """The recorded network (or ``model``, or the factory's) with the checkpoint's weights loaded."""
        custom = self.model_spec.get("name") == "custom"
        by_file = False  # the factory is the one the checkpoint recorded, not one the caller named
        if model is None and (model_factory or (custom and self.model_spec.get("factory"))):
            from .models.factory import check_recorded_factory

            recorded = self.model_spec.get("factory")
            if not model_factory:  # named by the file, not by the user: only a module of the current directory
                model_factory = check_recorded_factory(recorded, str(path))
                by_file = True
            elif recorded and recorded != model_factory:
                import sys

                print(f"notice: --model-factory {model_factory} is not the factory {path} recorded ({recorded}); its "
                      "weights are loaded into your network", file=sys.stderr, flush=True)
            model = factory_network(model_factory, self.config.get("seed"))
        if model is None and custom:
            raise CheckpointError(f"{path} holds a custom network ({self.model_spec.get('class', '?')}) and no model "
                                  "factory: pass the network, flatfl.load_checkpoint(path, model=net), or "
                                  "--model-factory module:function")
        what = f"model {self.model_spec.get('name')!r}" if model is None else \
            (f"{'the recorded model factory ' if by_file else '--model-factory '}{model_factory}" if model_factory
             else f"the given {type(model).__name__}")
        # your network against the recorded structure, taken before the spec wraps it; said once the weights fit
        # (a network whose shapes differ gets the weights' message)
        verdict = same_network(self.model_spec.get("structure"), model, what, path, model_factory) \
            if model is not None and custom else None
        if model is None:
            check_spec_size(self.model_spec, payload[key], path)  # before any memory is taken for it
        try:
            model = model_from_spec(self.model_spec, model)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot rebuild {what}: {e}") from None
        model = model.to(dtype=torch_dtype(self.precision))  # a given network too, before the weights are copied in
        try:
            model.load_state_dict(payload[key], strict=True)
        except RuntimeError as e:
            first = str(e).strip().splitlines()
            raise CheckpointError(f"{path}: weights do not fit {what} "
                                  f"({first[1].strip() if len(first) > 1 else first[0]})") from None
        if verdict is not None:
            verdict()
        return model

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    @property
    def partition(self):
        from .data.partition import Partition

        return Partition.from_dict(self.payload["partition"])

    def dataset(self):
        """The run's dataset (loaded on first use, from ``data_dir``)."""
        if self._dataset is None:
            info = self.payload["dataset"]
            if info.get("custom"):
                if not info.get("file"):
                    raise CheckpointError(f"{self.path}: the run's custom dataset {self.dataset_name!r} was not "
                                          "saved with it (over 1 GiB); evaluate the model on your own batches")
                self._dataset = load_run_data(run_data_file(self.path, info["file"]), info.get("sha256"),
                                              self.path)
            else:
                from .data import load_dataset

                self._dataset = load_dataset(self.dataset_name, self.data_dir, download=False)
        return self._dataset

    def eval_batches(self, split: str = "train", samples: int | None = None, batch_size: int = 256,
                     seed: int = 0, indices: np.ndarray | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Deterministic evaluation batches (normalised inputs in the checkpoint's precision, int64 labels) on the
        checkpoint's device.

        ``samples=None`` takes the whole split in dataset order; ``samples=N`` draws N indices once with ``seed``.
        ``indices`` restricts to given sample indices of the split (a client's data). No augmentation."""
        if samples is not None and samples <= 0:
            raise ConfigError(f"samples must be a positive integer, got {samples}")
        if batch_size <= 0:
            raise ConfigError(f"batch size must be a positive integer, got {batch_size}")
        ds = self.dataset()
        x, y = ds.split(split)
        idx = np.arange(len(y)) if indices is None else np.asarray(indices, dtype=np.int64)
        if samples is not None and samples < len(idx):
            idx = np.sort(np.random.default_rng(seed).choice(idx, size=samples, replace=False))
        out = []
        for s in range(0, len(idx), batch_size):
            b = torch.from_numpy(idx[s:s + batch_size])
            out.append((ds.normalize(x[b].to(self.device)).to(torch_dtype(self.precision)), y[b].to(self.device)))
        return out

    def client_batches(self, client: int, batch_size: int = 256, samples: int | None = None, seed: int = 0):
        """Evaluation batches of one client's training data (from the run's partition)."""
        part = self.partition
        if not 0 <= client < part.num_clients:
            raise CheckpointError(f"client {client} out of range: the run has {part.num_clients} clients")
        return self.eval_batches("train", samples=samples, batch_size=batch_size, seed=seed,
                                 indices=part.client_indices[client])

    # ----- client models (runs trained with --save-clients) -----
    def client_state(self) -> dict:
        f = self.path.parent / "clients.pt"
        if not f.is_file():
            f = self.path.parent.parent / "clients.pt"
        if not f.is_file():
            raise CheckpointError(f"no client models next to {self.path}: train the run with --save-clients")
        state = load_tensors(f, "client-models file")
        if not isinstance(state, dict) or not isinstance(state.get("params"), torch.Tensor) or state["params"].dim() != 2:
            raise CheckpointError(f"{f} is not a flatfl client-models file (no 'params' table)")
        mine = settings_digest(self.config)
        theirs = state.get("run_settings_sha256")
        if isinstance(theirs, str) and not is_settings_digest(self.config, theirs):
            raise CheckpointError(f"{f} holds the client models of another run (run settings sha256 {short(theirs)}; "
                                  f"{self.path} is of {short(mine)}); use the clients.pt its run wrote")
        part = self.payload.get("partition")
        indices = part.get("client_indices") if isinstance(part, dict) else None
        clients = len(indices) if isinstance(indices, list) else None
        if clients is not None and state["params"].shape[0] != clients:
            raise CheckpointError(f"{f} holds {state['params'].shape[0]} client models, but {self.path}'s run has "
                                  f"{clients} clients (run settings sha256 {short(mine)}): it belongs to another run")
        saved_round = state.get("round")
        if saved_round is not None and int(saved_round) != self.round:
            raise CheckpointError(f"{f} holds the client models of round {int(saved_round)}, but {self.path} is round "
                                  f"{self.round}: client metrics need the client models of the checkpoint's round "
                                  "(use the run's final.pt)")
        return state

    def client_model(self, client: int, state: dict | None = None) -> nn.Module:
        """Client ``client``'s latest local model (eval mode)."""
        import copy

        from .models.params import ParamLayout

        state = state or self.client_state()
        params = state["params"]
        if not 0 <= client < params.shape[0]:
            raise CheckpointError(f"client {client} out of range: the run has {params.shape[0]} clients")
        m = copy.deepcopy(self.model)
        ParamLayout(m).set(params[client].to(self.device))
        for name, buf in state.get("buffers", {}).items():
            m.get_buffer(name).copy_(buf[client])
        return m.eval()


def saved_precision(state: dict) -> str:
    """The floating type a run was trained in, read from its saved weights: ``float64`` when they are float64,
    else ``float32`` (the type of every run made before the setting existed)."""
    floats = [v.dtype for v in state.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return "float64" if floats and all(d == torch.float64 for d in floats) else "float32"


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", which: str = "server",
                    data_dir: str | Path | None = None, model: nn.Module | None = None,
                    model_factory: str | None = None, precision: str | None = None) -> Checkpoint:
    """Load a checkpoint file or a run directory's final checkpoint.

    A run on your own network: pass ``model`` (an ``nn.Module`` of the trained architecture; the weights are loaded
    into it) or ``model_factory="module:function"``; without either, the factory the run recorded is used. Weights
    are read with ``torch.load(weights_only=True)``; the model object is never unpickled. ``precision``: the
    floating type of the model and its batches (default the run's: float64 for a float64 run)."""
    device = resolve_device(device)
    p = resolve_checkpoint_path(path)
    return Checkpoint(read_checkpoint(p), p, device=device, which=which, data_dir=data_dir, model=model,
                      model_factory=model_factory, precision=precision)
