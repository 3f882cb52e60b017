"""Directions for 2-D loss surfaces (docs/analysis-protocols.md §6).

A direction is a list of tensors, one per parameter of the model in ``model.parameters()`` order (the parameters
that require a gradient, the layout :class:`~flatfl.analysis.operators.hessian.HessianOperator` uses). Two kinds:

* :func:`random_directions`: filter-normalised Gaussian directions (Li, Xu, Taylor, Studer & Goldstein 2018,
  "Visualizing the loss landscape of neural nets", Sec. 4). Each tensor is drawn from N(0, 1); for every tensor with
  more than one dimension, each output filter (the slice ``d[i]`` along dim 0) is rescaled to the norm of the
  matching weight filter ``w[i]``. Tensors with one dimension (biases, norm-layer affine parameters) are zeroed by
  default, as loss-landscape's ``--xignore biasbn``; with ``include_bn_bias=True`` they take the weight itself,
  as loss-landscape does without the ignore flag (a 1-D tensor's filters are single numbers, so filter normalisation
  would leave only a random sign; loss-landscape takes the weight's own sign).
* :func:`hessian_directions`: the top-2 Hessian eigenvectors (unit norm, largest algebraic eigenvalues), as in
  FedAlign's Fig. 1, computed with :func:`flatfl.analysis.estimators.eigen.top_eigenvalues`, or read from a file written by
  ``flatfl hessian --save-eigenvectors`` (:func:`directions_from_eigenvector_file`).

Every random draw comes from a ``torch.Generator`` seeded explicitly, on the CPU, so a seed gives the same
directions on every device.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from ...errors import CheckpointError, ConfigError
from ...utils.provenance import state_digest
from .eigenvector_file import load_eigenvectors

__all__ = ["direction_params", "filter_normalized_direction", "random_directions", "hessian_directions",
           "directions_from_eigenvector_file", "flatten_direction", "unflatten_direction"]


def direction_params(model: nn.Module) -> list[torch.Tensor]:
    """The parameters a direction covers: every parameter that requires a gradient, in ``parameters()`` order."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no parameters that require a gradient")
    return params


def _param_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


@torch.no_grad()
def filter_normalized_direction(params: Sequence[torch.Tensor], generator: torch.Generator,
                                include_bn_bias: bool = False) -> list[torch.Tensor]:
    """One filter-normalised Gaussian direction for ``params`` (Li et al. 2018; see the module docstring)."""
    direction = []
    for w in params:
        d = torch.randn(tuple(w.shape), generator=generator, dtype=torch.float32).to(dtype=w.dtype, device=w.device)
        if w.dim() <= 1:
            d = w.detach().clone() if include_bn_bias else torch.zeros_like(w)
        else:
            flat_d = d.reshape(d.shape[0], -1)
            flat_w = w.detach().reshape(w.shape[0], -1)
            scale = flat_w.norm(dim=1) / (flat_d.norm(dim=1) + 1e-10)
            d = (flat_d * scale[:, None]).reshape(w.shape)
        direction.append(d)
    return direction


def random_directions(model: nn.Module, seed: int = 0, include_bn_bias: bool = False
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two filter-normalised random directions, drawn one after the other from ``seed``."""
    params = direction_params(model)
    gen = torch.Generator().manual_seed(int(seed))
    first = filter_normalized_direction(params, gen, include_bn_bias)
    second = filter_normalized_direction(params, gen, include_bn_bias)
    return first, second


def unflatten_direction(vector: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A flat vector (the parameters' concatenation) as a list of parameter-shaped tensors (copies)."""
    sizes = [p.numel() for p in params]
    if vector.numel() != sum(sizes):
        raise ConfigError(f"a direction of length {vector.numel()} does not fit {sum(sizes)} parameters")
    parts = torch.split(vector.reshape(-1), sizes)
    return [t.reshape(p.shape).to(dtype=p.dtype, device=p.device).clone() for t, p in zip(parts, params)]


def flatten_direction(direction: Sequence[torch.Tensor]) -> torch.Tensor:
    """The concatenation of a direction's tensors (a flat vector)."""
    return torch.cat([d.reshape(-1) for d in direction])


def hessian_directions(model: nn.Module, batches, *, seed: int = 0, tol: float = 1e-3,
                       loss_fn: Callable | None = None, mode: str = "eval"):
    """The top-2 Hessian eigenvectors of the mean loss over ``batches`` (unit norm, largest algebraic).

    Returns ``((d1, d2), eigenvalues, info)``; ``info`` holds the residuals and the number of products used.
    """
    from ..operators.batches import as_batches
    from ..operators.curvatures import curvature_operator
    from ..operators.distributed import over_ranks
    from .eigen import top_eigenvalues

    # under torchrun: this rank's shard of the batches, products all-reduced (the same vectors on every rank)
    op = over_ranks(lambda shard: curvature_operator("hessian", model, shard, loss_fn=loss_fn, mode=mode),
                    as_batches(batches), mode=mode)
    if op.dim < 2:
        raise ConfigError("Hessian directions need a model with at least 2 parameters")
    result = top_eigenvalues(op, 2, tol=tol, seed=seed, return_vectors=True)
    op.release()
    params = op.params
    vectors = result.eigenvectors
    pair = (unflatten_direction(vectors[0], params), unflatten_direction(vectors[1], params))
    info = {"eigenvalues": result.eigenvalues.tolist(), "residuals": result.residuals.tolist(),
            "converged": result.converged.tolist(), "hvps": result.hvps, "method": result.method, "tol": tol}
    return pair, result.eigenvalues.tolist(), info


def directions_from_eigenvector_file(path, model: nn.Module):
    """The first two eigenvectors of an ``eigenvectors.pt`` (``flatfl hessian --save-eigenvectors``) for ``model``.

    The file's parameter names and shapes must match the model's; returns ``((d1, d2), eigenvalues)``.
    """
    saved = load_eigenvectors(path)
    if saved.weights_sha256 is None:
        raise CheckpointError(f"{path} does not record which model it was computed on (older flatfl): recompute it "
                              "with flatfl hessian --save-eigenvectors on this checkpoint")
    if saved.weights_sha256 != state_digest(model.state_dict()):
        raise CheckpointError(f"{path} holds eigenvectors of another checkpoint (round {saved.round}, "
                              f"{saved.checkpoint}), not of this model: recompute them on this checkpoint")
    params = direction_params(model)
    names = _param_names(model)
    shapes = [tuple(p.shape) for p in params]
    if list(saved.param_names) != names or [tuple(s) for s in saved.param_shapes] != shapes:
        raise CheckpointError(f"{path} holds eigenvectors of a different model (its parameter layout does not match)")
    if saved.vectors.shape[0] < 2:
        raise CheckpointError(f"{path} holds {saved.vectors.shape[0]} eigenvector(s); a surface needs 2 "
                              "(run flatfl hessian --top 2 --save-eigenvectors)")
    pair = (unflatten_direction(saved.vectors[0], params), unflatten_direction(saved.vectors[1], params))
    return pair, [float(v) for v in saved.eigenvalues[:2]]
