"""2-D convolutions in float64 on the CPU as one matrix product (docs/performance.md, "float64 on the CPU").

torch's CPU convolutions have a fast path (oneDNN) for float32 only; a float64 convolution, and every convolution
of its first and second derivatives, goes through ``slow_conv2d`` / ``slow_conv_transpose2d``, which loop over the
samples of a batch with one small matrix product each. That fallback was about 80% of a float64 Hessian-vector
product of the digits CNN (79% in a profile). :func:`conv2d_as_matmul` computes the same convolution as one matrix product over the
whole batch (a batched one per group for grouped convolutions): the weight as an (out, channels x kernel) matrix
times the input's sliding windows (``Tensor.unfold`` of the input viewed channels-first, copied once into a
(channels x kernel, samples x positions) matrix). Its first and second derivatives are again matrix products and window sums,
so the whole product runs on the BLAS matrix product. It differs from torch's convolution only in the order of
the floating-point sums (about 1e-16 relative). An ungrouped convolution with even padding (the common case) takes
its windows from ``F.unfold`` (torch's own im2col, whose derivative is its col2im) and returns a contiguous
(N, out, H, W) tensor, faster in a Hessian-vector product than windows from ``Tensor.unfold`` with a transposed
output (docs/performance.md, "float64 on the CPU"); other convolutions take those windows and return an (N, out, H, W) view of an (out, N, H, W) tensor.

:func:`matmul_convolutions` is the context in which every eligible ``torch.conv2d`` / ``F.conv2d`` call (float64
input and weight on the CPU, which is what the CPU presets train and analyse in) is computed so, for any
``nn.Module``, the user's own included; every other call goes to torch unchanged.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["conv2d_as_matmul", "matmul_convolutions", "stacked_convolutions", "torch_convolutions", "eligible"]

_CONV2D = (torch.conv2d, F.conv2d)


def _pair(value, name: str) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    value = tuple(value)
    if len(value) == 1:
        return int(value[0]), int(value[0])
    if len(value) != 2:
        raise ValueError(f"conv2d: {name} must be an int or two ints, got {value!r}")
    return int(value[0]), int(value[1])


def _padding(padding, kernel: tuple[int, int], dilation: tuple[int, int]) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) zero padding, torch's rule for 'same' (the odd extra on the bottom/right)."""
    if isinstance(padding, str):
        if padding == "valid":
            return 0, 0, 0, 0
        if padding == "same":
            total = [d * (k - 1) for k, d in zip(kernel, dilation)]
            return total[0] // 2, total[0] - total[0] // 2, total[1] // 2, total[1] - total[1] // 2
        raise ValueError(f"conv2d: padding must be 'valid', 'same' or ints, got {padding!r}")
    ph, pw = _pair(padding, "padding")
    return ph, ph, pw, pw


def conv2d_as_matmul(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride=1,
                     padding=0, dilation=1, groups: int = 1) -> torch.Tensor:
    """``F.conv2d(input, weight, bias, stride, padding, dilation, groups)`` as one matrix product (module
    docstring); an unbatched (C, H, W) input gives an unbatched output, as torch's does."""
    if input.dim() == 3:
        return conv2d_as_matmul(input.unsqueeze(0), weight, bias, stride, padding, dilation, groups).squeeze(0)
    n, c, h, w = input.shape
    out_ch, c_group, kh, kw = weight.shape
    sh, sw = _pair(stride, "stride")
    dh, dw = _pair(dilation, "dilation")
    top, bottom, left, right = _padding(padding, (kh, kw), (dh, dw))
    if top == bottom and left == right:
        if groups == 1:
            return _unfolded_conv2d(input, weight, bias, (sh, sw), (top, left), (dh, dw))
        return _grouped_unfolded_conv2d(input, weight, bias, (sh, sw), (top, left), (dh, dw), groups)
    x = input.transpose(0, 1)  # C, N, H, W (a view)
    if top or bottom or left or right:
        x = F.pad(x, (left, right, top, bottom))
    windows = x.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)  # C, N, Ho, Wo, kh', kw'
    if dh > 1 or dw > 1:
        windows = windows[..., ::dh, ::dw]
    ho, wo = windows.shape[2], windows.shape[3]
    # the one copy (im2col): (groups, channels of a group x kernel, positions), positions = N x Ho x Wo
    cols = windows.reshape(groups, c_group, n, ho, wo, kh, kw).permute(0, 1, 5, 6, 2, 3, 4)
    cols = cols.reshape(groups, c_group * kh * kw, n * ho * wo)
    flat = weight.reshape(groups, out_ch // groups, c_group * kh * kw)
    if groups == 1:
        out = flat[0] @ cols[0] if bias is None else torch.addmm(bias.unsqueeze(1), flat[0], cols[0])
    else:
        out = torch.bmm(flat, cols).reshape(out_ch, n * ho * wo)
        if bias is not None:
            out = out + bias.unsqueeze(1)
    return out.view(out_ch, n, ho, wo).transpose(0, 1)


def _unfolded_conv2d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, int],
                     padding: tuple[int, int], dilation: tuple[int, int]) -> torch.Tensor:
    """An ungrouped, evenly padded convolution of a batched input as one matrix product over ``F.unfold``'s windows,
    the output a contiguous (N, out, Ho, Wo) tensor."""
    n = input.shape[0]
    out_ch, c, kh, kw = weight.shape
    ho, wo = _output_size(input, (kh, kw), stride, padding, dilation)
    windows = F.unfold(input, (kh, kw), dilation=dilation, padding=padding, stride=stride)  # N, C x kh x kw, Ho x Wo
    cols = windows.transpose(0, 1).reshape(c * kh * kw, n * ho * wo)  # the one copy of the windows
    flat = weight.reshape(out_ch, c * kh * kw)
    out = flat @ cols if bias is None else torch.addmm(bias.unsqueeze(1), flat, cols)
    return out.view(out_ch, n, ho, wo).transpose(0, 1).contiguous()


def _grouped_unfolded_conv2d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                             groups: int) -> torch.Tensor:
    """A grouped, evenly padded convolution of a batched input as one batched matrix product over ``F.unfold``'s
    windows (one product per group), the output a contiguous (N, out, Ho, Wo) tensor."""
    n = input.shape[0]
    out_ch, c, kh, kw = weight.shape
    windows = F.unfold(input, (kh, kw), dilation=dilation, padding=padding, stride=stride)  # N, G x C x kh x kw, L
    positions = windows.shape[-1]
    cols = windows.view(n, groups, c * kh * kw, positions).permute(1, 2, 0, 3).reshape(groups, c * kh * kw,
                                                                                        n * positions)
    flat = weight.reshape(groups, out_ch // groups, c * kh * kw)
    out = torch.bmm(flat, cols) if bias is None else torch.baddbmm(bias.view(groups, -1, 1), flat, cols)
    ho, wo = _output_size(input, (kh, kw), stride, padding, dilation)
    return out.view(groups, out_ch // groups, n, ho * wo).permute(2, 0, 1, 3).reshape(n, out_ch, ho, wo)


def _output_size(input: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
                 dilation: tuple[int, int]) -> tuple[int, int]:
    """(Ho, Wo) of an evenly padded convolution of the batched ``input``."""
    return tuple((size + 2 * p - d * (k - 1) - 1) // s + 1
                 for size, k, s, p, d in zip(input.shape[2:], kernel, stride, padding, dilation))


def eligible(args: tuple, kwargs: dict) -> bool:
    """Whether a ``conv2d`` call is one this module computes: float64 input and weight tensors on the CPU, the input
    of 3 or 4 dimensions."""
    x = args[0] if args else kwargs.get("input")
    w = args[1] if len(args) > 1 else kwargs.get("weight")
    return (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dtype == torch.float64
            and w.dtype == torch.float64 and x.device.type == "cpu" and w.device.type == "cpu"
            and x.dim() in (3, 4) and w.dim() == 4)


_TORCH_ONLY: list[bool] = []  # non-empty inside torch_convolutions()


@contextlib.contextmanager
def torch_convolutions() -> Iterator[None]:
    """Within the block, :func:`matmul_convolutions` does nothing: torch's own convolutions everywhere (for
    benchmarks and tests that compare the two)."""
    _TORCH_ONLY.append(True)
    try:
        yield
    finally:
        _TORCH_ONLY.pop()


class _MatmulConvolutions(TorchFunctionMode):
    def __init__(self, grouped_only: bool = False) -> None:
        super().__init__()
        self.grouped_only = grouped_only

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CONV2D and eligible(args, kwargs) and (not self.grouped_only or _grouped(args, kwargs)):
            return conv2d_as_matmul(*args, **kwargs)
        return func(*args, **kwargs)


def _grouped(args: tuple, kwargs: dict) -> bool:
    """A grouped call on plain (not vmapped) tensors: a channel-stacked network's convolution (one group a client)."""
    groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
    x = args[0] if args else kwargs.get("input")
    return int(groups) > 1 and not torch._C._functorch.is_batchedtensor(x)


@contextlib.contextmanager
def stacked_convolutions(enabled: bool = True) -> Iterator[None]:
    """Within the block, eligible *grouped* 2-D convolutions (a channel-stacked cohort's: one group a client) are
    :func:`conv2d_as_matmul`, one batched matrix product over the groups, where torch's float64 fallback loops over
    groups and samples; ungrouped ones stay torch's (docs/performance.md, "float64 on the CPU")."""
    if not enabled or _TORCH_ONLY:
        yield
        return
    with _MatmulConvolutions(grouped_only=True):
        yield


@contextlib.contextmanager
def matmul_convolutions(enabled: bool = True) -> Iterator[None]:
    """Within the block, eligible 2-D convolutions (:func:`eligible`) are :func:`conv2d_as_matmul`; ``enabled=False``
    changes nothing, and so does the block inside :func:`torch_convolutions`."""
    if not enabled or _TORCH_ONLY:
        yield
        return
    with _MatmulConvolutions():
        yield
