"""Two ways to take a float64 convolution's windows inside a Hessian-vector product, timed against each other.

flatfl computes float64 convolutions on the CPU as one matrix product (flatfl/models/convolution.py). An ungrouped,
evenly padded convolution takes its windows from ``F.unfold`` (torch's im2col; its derivative is col2im) and returns
a contiguous (N, out, H, W) tensor. The formulation before it, kept here for the comparison, took the windows with
``Tensor.unfold`` views of the input laid out channels-first and returned an (N, out, H, W) view of an (out, N, H, W)
tensor. Both give the same products to rounding.

The model: the quick preset's digits CNN after one FedAvg run of its settings (trained here, float64, one thread);
the products: the ``hessian`` analysis's (double backward over the 1,442 training images in batches of 512, the
first-order graphs kept). The two are timed in alternation, ``--repeats`` rounds of 3 products each, and the ratio of
their medians printed.

    python benchmarks/conv_windows.py              # about a minute on 2 cores
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import flatfl.models.convolution as convolution
from flatfl.analysis.operators.hessian import HessianOperator
from flatfl.checkpoint import load_checkpoint

QUICK_RUN = ["--dataset", "digits", "--model", "digits-cnn", "--clients", "20", "--participation", "0.5",
             "--sampling", "bernoulli", "--partition", "dirichlet", "--alpha", "0.3", "--rounds", "30",
             "--local-epochs", "2", "--batch-size", "50", "--lr", "0.1", "--lr-decay", "0.998", "--weight-decay",
             "1e-3", "--clip", "10", "--eval-every", "10", "--checkpoint-every", "30", "--precision", "float64",
             "--threads", "1", "--quiet"]


def pair(value) -> tuple[int, int]:
    """An int or two ints as two ints (the digits CNN's convolutions give ints)."""
    return (value, value) if isinstance(value, int) else tuple(value)


def tensor_unfold_windows(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """The previous formulation: windows as ``Tensor.unfold`` views of the channels-first input, copied once into a
    (channels x kernel, samples x positions) matrix; the output a view of an (out, N, H, W) tensor."""
    n, c, h, w = input.shape
    out_ch, _, kh, kw = weight.shape
    (sh, sw), (ph, pw), (dh, dw) = (pair(value) for value in (stride, padding, dilation))
    x = F.pad(input.transpose(0, 1), (pw, pw, ph, ph))
    windows = x.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)[..., ::dh, ::dw]
    ho, wo = windows.shape[2], windows.shape[3]
    cols = windows.permute(0, 4, 5, 1, 2, 3).reshape(c * kh * kw, n * ho * wo)
    flat = weight.reshape(out_ch, c * kh * kw)
    out = flat @ cols if bias is None else torch.addmm(bias.unsqueeze(1), flat, cols)
    return out.view(out_ch, n, ho, wo).transpose(0, 1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7, help="alternating rounds of 3 products each (default 7)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "flatfl", "train", *QUICK_RUN, "--out", str(run)], check=True)
        ckpt = load_checkpoint(run / "final.pt")
    batches = ckpt.eval_batches(split="train", samples=None, batch_size=512, seed=0)
    v = torch.randn(sum(p.numel() for p in ckpt.model.parameters()), 1, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    ways = {"F.unfold windows, contiguous output (flatfl)": convolution.conv2d_as_matmul,
            "Tensor.unfold windows, transposed output (before)": tensor_unfold_windows}
    ops, products = {}, {}
    for name, conv in ways.items():
        convolution.conv2d_as_matmul = conv
        ops[name] = HessianOperator(ckpt.model, batches, products="double-backward")
        products[name] = ops[name].matmat(v)  # the first-order graphs built and kept
    times: dict = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, conv in ways.items():
            convolution.conv2d_as_matmul = conv
            start = time.perf_counter()
            for _ in range(3):
                ops[name].matmat(v)
            times[name].append(1e3 * (time.perf_counter() - start) / 3)
    ours, before = ways
    apart = float((products[ours] - products[before]).norm() / products[before].norm())
    print(f"a float64 Hessian-vector product of the digits CNN ({v.shape[0]:,} parameters, "
          f"{ops[ours].num_samples:,} images, batches of 512), one thread, median of {args.repeats} rounds of 3:")
    for name in ways:
        print(f"  {name}: {statistics.median(times[name]):.1f} ms")
    print(f"ratio flatfl / before: {statistics.median(times[ours]) / statistics.median(times[before]):.2f}; "
          f"the products {apart:.1e} apart (relative)")


if __name__ == "__main__":
    main()
