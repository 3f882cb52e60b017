"""Checks of a network before any training: it takes the data's inputs, trains on every client's batches and is
rebuilt by its spec. Each is a shape probe or a forward pass that draws nothing from the run's random generators.
A network or data that cannot train is one ConfigError line naming what to change; a piece that changes the network
beyond its spec is a RuntimeError (a bug of the piece)."""
from __future__ import annotations

import torch

from ..errors import ConfigError

__all__ = ["BATCH_NORMS", "INSTANCE_NORMS", "values_per_channel", "check_no_batch_of_one", "check_model_fits_data",
           "check_spec_rebuilds"]

#: normalisations whose training statistics are taken over the batch: they need two values per channel in a batch
BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)
INSTANCE_NORMS = (torch.nn.InstanceNorm1d, torch.nn.InstanceNorm2d, torch.nn.InstanceNorm3d)


def values_per_channel(model: torch.nn.Module, input_shape) -> list[tuple[str, torch.nn.Module, int]]:
    """(name, layer, values per channel of one sample) of each batch or instance normalisation that one input of
    ``input_shape`` reaches: a shape probe (eval mode, no gradient, the random generators untouched). Empty when
    the model has no such layer or cannot run the probe (the data check reports that)."""
    norms = [(name, m) for name, m in model.named_modules() if isinstance(m, BATCH_NORMS + INSTANCE_NORMS)]
    if not norms:
        return []
    seen: dict[int, int] = {}

    def probe(module, inputs, output):
        x = inputs[0]
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] > 0 and x.shape[1] > 0:
            seen.setdefault(id(module), x.numel() // (x.shape[0] * x.shape[1]))

    param = next(iter(model.parameters()), None)
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.get_default_dtype()
    device = param.device if param is not None else None
    handles = [m.register_forward_hook(probe) for _, m in norms]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(torch.zeros(1, *input_shape, dtype=dtype, device=device))
    except Exception:
        return []
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return [(name, m, seen[id(m)]) for name, m in norms if id(m) in seen]


def check_no_batch_of_one(model: torch.nn.Module, sizes, batch_size: int, input_shape) -> None:
    """A batch normalisation needs more than one value per channel in a training batch: refuse, before training,
    a client whose data leaves a last batch of one sample (n mod B == 1) when some batch normalisation sees a single
    value per channel of one sample (BatchNorm1d; BatchNorm2d on a 1x1 map, e.g. ResNet-18's last stage on 8x8
    inputs), naming the client, the layer and what to change. An instance normalisation over one value fails on
    every batch: refused too. Found by a shape probe of one input."""
    found = values_per_channel(model, input_shape)
    single = [(name, m) for name, m, values in found if values == 1]
    instance = next((name for name, m in single if isinstance(m, INSTANCE_NORMS)), None)
    if instance is not None:
        raise ConfigError(f"the network's {instance} normalises a single value per channel of each sample; it "
                          f"cannot train on {'x'.join(str(s) for s in input_shape[1:])} inputs")
    if not single:
        return
    layer = single[0][0] or "BatchNorm"
    for k, n in enumerate(int(x) for x in sizes):
        if n % batch_size == 1:
            raise ConfigError(f"client {k} holds {n} samples: with --batch-size {batch_size} its last batch has 1 "
                              f"sample, on which the network's batch normalisation {layer} (one value per channel "
                              "and sample) cannot train; choose another --batch-size or --clients")


def check_model_fits_data(model: torch.nn.Module, ds) -> None:
    """One forward pass of one training item through the user's network (eval mode, no gradient, the random
    generators untouched): a network that cannot take the inputs, or has fewer outputs than the data has classes,
    is one ConfigError line now instead of a torch error mid-training."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"your network ({type(model).__name__}) has no trainable parameter (none, or every one "
                          "with requires_grad=False): there is nothing to train")
    param = next(iter(model.parameters()), None)
    x = ds.normalize(ds.train_x[:1])
    if param is not None:
        x = x.to(device=param.device, dtype=param.dtype if param.is_floating_point() else x.dtype)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = model(x)
    except Exception as e:
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        raise ConfigError(f"your network cannot take the data's inputs (one item of shape {tuple(x.shape[1:])}): "
                          f"{type(e).__name__}: {reason}") from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor):
        kind = f"a {type(out).__name__}" + (f" with keys {', '.join(map(repr, list(out)[:4]))}"
                                             if isinstance(out, dict) else "")
        raise ConfigError(f"your network returns {kind} for one item; it must return a tensor of class scores "
                          "(batch, classes), e.g. return the logits themselves rather than a dict holding them")
    if isinstance(out, torch.Tensor):
        if out.dim() != 2 or out.shape[0] != 1:
            raise ConfigError(f"your network returns shape {tuple(out.shape)} for one item; it must return one row "
                              "of class scores per input (batch, classes)")
        if out.shape[1] < ds.num_classes:
            raise ConfigError(f"the data's labels go up to {ds.num_classes - 1} ({ds.num_classes} classes) but your "
                              f"network has {out.shape[1]} outputs")


def check_spec_rebuilds(model, spec: dict, algo: str, reg: str) -> None:
    """The network rebuilt from ``spec`` has the trained model's parameters and buffers (names and shapes): an
    algorithm or regularizer that changes the architecture must record the change in the spec
    (:mod:`flatfl.models.model_spec`), or analysis could not load its checkpoints. Custom networks are rebuilt by their
    factory and are not checked here. Draws no random numbers from the run's generators."""
    if spec.get("name") == "custom":
        return
    from ..models import model_from_spec

    with torch.random.fork_rng(devices=[]):
        rebuilt = model_from_spec(spec)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if shapes != {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()}:
        raise RuntimeError(f"--algo {algo} / --reg {reg} change the network beyond what its spec records "
                           "(flatfl.models.model_spec): checkpoints would not load for analysis")
