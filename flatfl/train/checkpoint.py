"""Checkpoints: atomic save, validated load, and the :class:`Checkpoint` behind ``flatfl.load_checkpoint``.

A model checkpoint (``final.pt``, ``checkpoints/round_XXXX.pt``) is a dict of tensors and plain values, loadable
with ``torch.load(weights_only=True)``. It holds everything needed to rebuild the model and its data without the
original command line: the model's registry name and arguments, the weights of the server model and of the average
of all clients' latest models, the dataset name and directory, the partition, the resolved config, the round, the
metrics so far, the RNG states and the flatfl version.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import CheckpointError
from ..utils.io import atomic_torch_save

FORMAT = "flatfl-checkpoint"
FORMAT_VERSION = 1


def save_checkpoint(path: str | Path, payload: dict) -> None:
    payload = dict(payload, format=FORMAT, format_version=FORMAT_VERSION)
    atomic_torch_save(payload, path)


def _read(path: Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a checkpoint (no final.pt in it)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, pickle garbage, a text file...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is not a readable flatfl checkpoint (corrupt or truncated: {reason[:160]})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a flatfl checkpoint (no flatfl header)")
    if payload.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{path} was written by a newer flatfl (format {payload['format_version']})")
    return payload


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
                 data_dir: str | Path | None = None, model: nn.Module | None = None, model_factory: str | None = None):
        from ..models import build_model

        self.path = Path(path)
        self.payload = payload
        self.device = torch.device(device)
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
        custom = self.model_spec.get("name") == "custom"
        if model is None and (model_factory or (custom and self.model_spec.get("factory"))):
            from ..models.factory import model_from_factory

            model_factory = model_factory or self.model_spec["factory"]
            model = model_from_factory(model_factory)
        if model is None and custom:
            raise CheckpointError(f"{path} holds a custom network ({self.model_spec.get('class', '?')}) and no model "
                                  "factory: pass the network, flatfl.load_checkpoint(path, model=net), or "
                                  "--model-factory module:function")
        what = f"model {self.model_spec.get('name')!r}" if model is None else \
            (f"--model-factory {model_factory}" if model_factory else f"the given {type(model).__name__}")
        try:
            if model is None:
                model = build_model(self.model_spec["name"], **self.model_spec["kwargs"])
            model = _apply_wrappers(model, self.config)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot rebuild {what}: {e}") from None
        try:
            model.load_state_dict(payload[key], strict=True)
        except RuntimeError as e:
            first = str(e).strip().splitlines()
            raise CheckpointError(f"{path}: weights do not fit {what} "
                                  f"({first[1].strip() if len(first) > 1 else first[0]})") from None
        self.model: nn.Module = model.to(self.device).eval()
        self._dataset = None

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    @property
    def partition(self):
        from ..data.partition import Partition

        return Partition.from_dict(self.payload["partition"])

    def dataset(self):
        """The run's dataset (loaded on first use, from ``data_dir``)."""
        if self._dataset is None:
            info = self.payload["dataset"]
            if info.get("custom"):
                from ..data.datasets import load_saved_dataset

                if not info.get("file"):
                    raise CheckpointError(f"{self.path}: the run's custom dataset {self.dataset_name!r} was not "
                                          "saved with it (over 1 GiB); evaluate the model on your own batches")
                here = self.path.parent
                f = here / info["file"] if (here / info["file"]).is_file() else here.parent / info["file"]
                self._dataset = load_saved_dataset(f)
            else:
                from ..data import load_dataset

                self._dataset = load_dataset(self.dataset_name, self.data_dir, download=False)
        return self._dataset

    def eval_batches(self, split: str = "train", samples: int | None = None, batch_size: int = 256,
                     seed: int = 0, indices: np.ndarray | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Deterministic evaluation batches (normalised float32 inputs, int64 labels) on the checkpoint's device.

        ``samples=None`` takes the whole split in dataset order; ``samples=N`` draws N indices once with ``seed``.
        ``indices`` restricts to given sample indices of the split (a client's data). No augmentation."""
        from ..errors import ConfigError

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
            out.append((ds.normalize(x[b].to(self.device)), y[b].to(self.device)))
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
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except Exception:
            raise CheckpointError(f"{f} is not a readable client-models file (corrupt or truncated)") from None

    def client_model(self, client: int, state: dict | None = None) -> nn.Module:
        """Client ``client``'s latest local model (eval mode)."""
        import copy

        from .params import ParamLayout

        state = state or self.client_state()
        params = state["params"]
        if not 0 <= client < params.shape[0]:
            raise CheckpointError(f"client {client} out of range: the run has {params.shape[0]} clients")
        m = copy.deepcopy(self.model)
        ParamLayout(m).set(params[client].to(self.device))
        for name, buf in state.get("buffers", {}).items():
            m.get_buffer(name).copy_(buf[client])
        return m.eval()


def _apply_wrappers(model: nn.Module, config: dict) -> nn.Module:
    """Re-apply architecture changes made by the run's algorithm and regularizer (e.g. MOON's projection head)."""
    from .components import ALGORITHMS, REGULARIZERS, load_all

    load_all()
    params = config.get("params", {})
    algo = ALGORITHMS.get_class(config.get("algo", "fedavg"))
    model = algo.wrap_model(model, algo.resolve(params))
    reg = REGULARIZERS.get_class(config.get("reg", "none"))
    return reg.prepare_model(model, reg.resolve(params))


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", which: str = "server",
                    data_dir: str | Path | None = None, model: nn.Module | None = None,
                    model_factory: str | None = None) -> Checkpoint:
    """Load a checkpoint file or a run directory's final checkpoint.

    A run on your own network: pass ``model`` (an ``nn.Module`` of the trained architecture; the weights are loaded
    into it) or ``model_factory="module:function"``; without either, the factory the run recorded is used. Weights
    are read with ``torch.load(weights_only=True)``; the model object is never unpickled."""
    from ..errors import ConfigError

    dev = str(device)
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {dev!r} asked for, but CUDA is not available on this machine")
    p = resolve_checkpoint_path(path)
    return Checkpoint(_read(p), p, device=device, which=which, data_dir=data_dir, model=model,
                      model_factory=model_factory)


def finite(x: float) -> bool:
    return math.isfinite(x)
