"""flatfl's Hessian engine against PyHessian on the MAN CIFAR-100 CNN (spec/analysis.md §2-3).

Same model (random weights, seed 0), same data (N random CIFAR-shaped inputs, random labels; one batch, so both
tools keep the first-order graph), same machine, one run. Prints:

1. HVP time over gradient time (flatfl's operator);
2. top eigenvalue: time ratio PyHessian / flatfl, each tool's relative error;
3. top 20: time ratio PyHessian / flatfl and each tool's maximum relative error against a tight reference
   (scipy ``eigsh``, ARPACK, tol 1e-6, on flatfl's operator: an independent Lanczos implementation);
4. top 200 (flatfl only): HVPs per eigenvalue on the MAN CIFAR CNN trained for a few rounds on CIFAR-sized data
   (digits upsampled to 3x32x32: reduced scale, no download; a trained model is the setting of MAN Fig. 4a), on
   a trained digits CNN beside scipy ``eigsh``'s count at tol 1e-6, and with ``--large-random`` on the random-weight
   CNN of sections 1-3;
5. trace at an equal HVP budget: standard error of Hutch++ and of Hutchinson, on the CNN and on the trained digits
   CNN (and PyHessian's trace rule for context: its estimate, its sample count and the standard error it does not
   report).

Targets (issue 3): top-20 >= 5x faster than PyHessian with a smaller error; top-200 <= 3 HVPs per eigenvalue;
HVP <= 3x a gradient.

    python benchmarks/hessian_vs_pyhessian.py            # full: 512 inputs, k = 20 and 200 (~30-60 min on 2 cores)
    python benchmarks/hessian_vs_pyhessian.py --quick    # 128 inputs, k = 10 and 50, smaller budgets
"""
from __future__ import annotations

import argparse
import copy
import platform
import sys
import time

import numpy as np
import scipy.sparse.linalg as spla
import torch
import torch.nn as nn

from flatfl.analysis import HessianOperator, hutchinson_trace, hutchpp_trace, top_eigenvalues


def man_cifar_cnn() -> nn.Module:
    """The MAN / FedDyn CIFAR-100 CNN (spec/algorithms.md §20), from the registry when available."""
    try:
        from flatfl.models import build_model

        return build_model("cifar-cnn", num_classes=100, in_channels=3, image_size=32)
    except Exception:  # the registry is optional for this script
        return nn.Sequential(
            nn.Conv2d(3, 64, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(64, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(1600, 384), nn.ReLU(), nn.Linear(384, 192), nn.ReLU(), nn.Linear(192, 100),
        )


class PyHessianCounter:
    """Counts PyHessian's Hessian-vector products (single-batch mode) by wrapping the function it calls."""

    def __init__(self):
        import pyhessian  # noqa: F401 - makes sure the submodule is loaded

        self.module = sys.modules["pyhessian.hessian"]
        self.original = self.module.hessian_vector_product
        self.count = 0

        def counting(*args, **kwargs):
            self.count += 1
            return self.original(*args, **kwargs)

        self.module.hessian_vector_product = counting

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def trained_digits_operator(rounds: int):
    """A digits CNN trained by flatfl for a few rounds, with 512 training samples (as in spec/analysis.md §2)."""
    import tempfile

    from click.testing import CliRunner

    import flatfl
    from flatfl.cli import main as cli

    tmp = tempfile.mkdtemp(prefix="flatfl-bench-")
    result = CliRunner().invoke(cli, ["train", "--dataset", "digits", "--model", "digits-cnn", "--rounds", str(rounds),
                                      "--quiet", "--out", f"{tmp}/run"], catch_exceptions=False)
    if result.exit_code != 0:
        raise RuntimeError(result.output)
    ckpt = flatfl.load_checkpoint(f"{tmp}/run/final.pt")
    return HessianOperator(ckpt.model, ckpt.eval_batches("train", samples=512, seed=0))


def trained_cifar_operator(rounds: int, inputs: int):
    """The MAN CIFAR CNN trained by flatfl's engine for a few rounds on CIFAR-sized data, with ``inputs`` training
    samples: the embedded digits upsampled 4x to 32x32 and repeated over 3 channels (100 output classes, the same
    815,332 parameters). A reduced-scale stand-in of a trained CIFAR model (no dataset download here): the spectrum
    of a trained network, with its few separated outliers, is what top-k Lanczos meets in practice (MAN Fig. 4a)."""
    import tempfile
    from pathlib import Path

    from flatfl.train.config import RunConfig
    from flatfl.data import load_dataset
    from flatfl.data.datasets import ImageDataset
    from flatfl.train.catalog import load_all
    from flatfl.train.engine import Trainer

    load_all()
    d = load_dataset("digits")

    def up(t):
        return t.repeat_interleave(4, 2).repeat_interleave(4, 3).repeat(1, 3, 1, 1)

    ds = ImageDataset(name="digits-32x32x3", train_x=up(d.train_x), train_y=d.train_y, test_x=up(d.test_x),
                      test_y=d.test_y, num_classes=100, mean=d.mean * 3, std=d.std * 3, max_value=d.max_value)
    cfg = RunConfig(dataset="digits", model="cifar-cnn", clients=2, participation=1.0, partition="iid", rounds=rounds,
                    local_epochs=1, batch_size=50, seed=0, eval_every=rounds, checkpoint_every=10**9).validate()
    trainer = Trainer(cfg, Path(tempfile.mkdtemp(prefix="flatfl-bench-")) / "run", quiet=True, dataset=ds)
    trainer.run()
    trainer.load_into_model(trainer.theta, trainer.buffers)
    model = trainer.model.eval()
    x, y = ds.normalize(ds.train_x[:inputs]), ds.train_y[:inputs]
    return HessianOperator(model, [(x, y)]), float(trainer.metrics[-1]["test_acc"])


def say(*parts):
    print(*parts, flush=True)


class Timing(float):
    """Wall-clock seconds (the float value) with the process CPU seconds beside them (``.cpu``).

    Other jobs share this machine's 2 cores, so wall time depends on when a step ran; the CPU time this process got
    is far less sensitive to that, and ratios are printed for both.
    """

    def __new__(cls, wall: float, cpu: float):
        obj = super().__new__(cls, wall)
        obj.cpu = cpu
        return obj


def timed(fn):
    start, start_cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, Timing(time.perf_counter() - start, time.process_time() - start_cpu)


def ratios(theirs: Timing, ours: Timing) -> str:
    return f"wall {theirs / ours:.1f}x, CPU {theirs.cpu / ours.cpu:.1f}x"


def max_rel_error(values, reference):
    values = np.sort(np.asarray(values, dtype=float))[::-1]
    reference = np.asarray(reference, dtype=float)[: len(values)]
    return float(np.max(np.abs(values - reference) / np.abs(reference)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="128 inputs, k = 10 / 50, trace budget 30")
    ap.add_argument("--inputs", type=int, default=None, help="number of random CIFAR inputs (default 512)")
    ap.add_argument("--k", type=int, default=None, help="top-k compared with PyHessian (default 20)")
    ap.add_argument("--k-large", type=int, default=None, help="top-k for the HVPs-per-eigenvalue figure (200)")
    ap.add_argument("--trace-budget", type=int, default=None, help="HVP budget of each trace estimator (90)")
    ap.add_argument("--skip-pyhessian-topk", action="store_true", help="do not run PyHessian's top-k (slowest)")
    ap.add_argument("--skip-large", action="store_true", help="skip section 4 (top 200)")
    ap.add_argument("--skip-trace", action="store_true", help="skip section 5 (trace)")
    ap.add_argument("--digits-rounds", type=int, default=None, help="training rounds of the digits CNN (20; 0 = skip)")
    ap.add_argument("--cifar-rounds", type=int, default=None, help="training rounds of the CIFAR CNN of section 4 "
                    "(10)")
    ap.add_argument("--large-random", action="store_true", help="section 4 also on the random-weight CNN and "
                    "random inputs of sections 1-3 (their flat bulk spectrum is the hardest case: about 20 min more)")
    args = ap.parse_args(argv)
    inputs = args.inputs or (128 if args.quick else 512)
    k = args.k or (10 if args.quick else 20)
    k_large = args.k_large or (50 if args.quick else 200)
    budget = args.trace_budget or (30 if args.quick else 90)
    digits_rounds = args.digits_rounds if args.digits_rounds is not None else (5 if args.quick else 20)
    cifar_rounds = args.cifar_rounds if args.cifar_rounds is not None else (3 if args.quick else 10)

    from pyhessian import hessian as PyHessian

    counter = PyHessianCounter()

    torch.manual_seed(0)
    model = man_cifar_cnn().eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(inputs, 3, 32, 32, generator=gen)
    y = torch.randint(0, 100, (inputs,), generator=gen)
    op = HessianOperator(model, [(x, y)])
    say(f"# flatfl vs PyHessian: MAN CIFAR CNN ({op.dim:,} parameters), {inputs} random CIFAR inputs, one batch")
    say(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
        f", python {platform.python_version()}")

    # 1. cost of one HVP relative to a gradient ----------------------------------------------------------------
    v = torch.randn(op.dim, generator=gen)
    op.matvec(v)  # builds and keeps the first-order graph
    grad_times = [timed(op.gradient)[1] for _ in range(3)]
    hvp_times = [timed(lambda: op.matvec(v))[1] for _ in range(3)]
    grad_t, hvp_t = float(np.median(grad_times)), float(np.median(hvp_times))
    say(f"\n[1] gradient {grad_t:.3f} s, HVP {hvp_t:.3f} s (graph kept): HVP / gradient = {hvp_t / grad_t:.2f}"
        f"  (target <= 3)")

    # reference eigenvalues: ARPACK at a tight tolerance on flatfl's operator ----------------------------------
    start_hvps = op.hvps
    lin = spla.LinearOperator(
        (op.dim, op.dim), dtype=np.float64,
        matvec=lambda u: op.matvec(torch.from_numpy(np.ascontiguousarray(u, dtype=np.float32).ravel()))
        .double().numpy(),
    )
    v0 = np.random.default_rng(0).standard_normal(op.dim)
    (ref_vals, _), ref_t = timed(lambda: spla.eigsh(lin, k=k, which="LA", tol=1e-6, v0=v0, ncv=max(3 * k, 40)))
    reference = np.sort(ref_vals)[::-1]
    say(f"\n[ref] scipy eigsh k={k} tol=1e-6: {op.hvps - start_hvps} HVPs, {ref_t:.1f} s; "
        f"top {min(k, 5)}: {np.round(reference[:5], 4).tolist()}")

    # 2. top eigenvalue -----------------------------------------------------------------------------------------
    torch.manual_seed(0)
    ph_model = copy.deepcopy(model)
    ph = PyHessian(ph_model, nn.CrossEntropyLoss(), data=(x, y), cuda=False)
    counter.take()
    (ph_top, _), ph_top_t = timed(lambda: ph.eigenvalues(top_n=1))
    ph_top_hvps = counter.take()
    ours_top, ours_top_t = timed(lambda: top_eigenvalues(op, 1, seed=0))
    loose, loose_t = timed(lambda: top_eigenvalues(op, 1, tol=3e-2, seed=0))
    say(f"\n[2] top eigenvalue: PyHessian {ph_top[0]:.5f} in {ph_top_t:.1f} s, {ph_top_hvps} HVPs (error "
        f"{abs(ph_top[0] - reference[0]) / reference[0]:.2e}); flatfl {ours_top.eigenvalues[0]:.5f} in "
        f"{ours_top_t:.1f} s, {ours_top.hvps} HVPs (error {abs(ours_top.eigenvalues[0] - reference[0]) / reference[0]:.2e}"
        f", residual {ours_top.residuals[0]:.1e}); time ratio PyHessian / flatfl: {ratios(ph_top_t, ours_top_t)}")
    say(f"    flatfl at residual tolerance 3e-2 (an error nearer PyHessian's): {loose.eigenvalues[0]:.5f} in "
        f"{loose_t:.1f} s, {loose.hvps} HVPs (error {abs(loose.eigenvalues[0] - reference[0]) / reference[0]:.2e});"
        f" time ratio PyHessian / flatfl: {ratios(ph_top_t, loose_t)}")

    # 3. top k ----------------------------------------------------------------------------------------------------
    ours_k, ours_k_t = timed(lambda: top_eigenvalues(op, k, seed=0))
    ours_err = max_rel_error(ours_k.eigenvalues, reference)
    say(f"\n[3] top {k}: flatfl {ours_k_t:.1f} s, {ours_k.hvps} HVPs ({ours_k.hvps / k:.2f} per eigenvalue), "
        f"max relative error {ours_err:.2e}, max residual / lambda {np.max(ours_k.residuals / ours_k.eigenvalues):.1e}")
    start_hvps = op.hvps
    _, eigsh_t = timed(lambda: spla.eigsh(lin, k=k, which="LA", tol=1e-4, v0=v0))
    eigsh_hvps = op.hvps - start_hvps
    tight, tight_t = timed(lambda: top_eigenvalues(op, k, tol=1e-4, seed=0))
    say(f"    at tol 1e-4 on the same operator: scipy eigsh {eigsh_t:.1f} s, {eigsh_hvps} HVPs; flatfl {tight_t:.1f} s, "
        f"{tight.hvps} HVPs (max relative error {max_rel_error(tight.eigenvalues, reference):.1e}); time ratio eigsh "
        f"/ flatfl: {ratios(eigsh_t, tight_t)}")
    if not args.skip_pyhessian_topk:
        torch.manual_seed(0)
        ph = PyHessian(copy.deepcopy(model), nn.CrossEntropyLoss(), data=(x, y), cuda=False)
        counter.take()
        (ph_vals, _), ph_k_t = timed(lambda: ph.eigenvalues(top_n=k))
        ph_k_hvps = counter.take()
        ph_err = max_rel_error(ph_vals, reference)
        unsorted = bool(np.any(np.diff(ph_vals) > 0))
        say(f"    PyHessian {ph_k_t:.1f} s, {ph_k_hvps} HVPs ({ph_k_hvps / k:.1f} per eigenvalue), max relative "
            f"error {ph_err:.2e} (after sorting; returned "
            f"{'unsorted' if unsorted else 'sorted'})")
        say(f"    time ratio PyHessian / flatfl: {ratios(ph_k_t, ours_k_t)}; HVP ratio {ph_k_hvps / ours_k.hvps:.1f}x"
            f" (target >= 5x); error ratio "
            f"PyHessian / flatfl = {ph_err / max(ours_err, 1e-300):.1e}")

    need_digits = digits_rounds > 0 and not (args.skip_large and args.skip_trace)
    digits = trained_digits_operator(digits_rounds) if need_digits else None
    if not args.skip_large:
        section_large(op if args.large_random else None, k, k_large, reference, digits, digits_rounds, cifar_rounds,
                      inputs)
    if not args.skip_trace:
        section_trace(op, model, x, y, budget, digits, PyHessian, counter)
    say(f"\n# total HVPs by flatfl's operator in this run: {op.hvps}")


def section_large(op, k, k_large, reference, digits, digits_rounds, cifar_rounds, inputs):
    # 4. top k_large (flatfl only) ------------------------------------------------------------------------------
    say(f"\n[4] top {k_large} (flatfl only; target <= 3 HVPs per eigenvalue)")
    if cifar_rounds > 0:
        (trained_op, acc), train_t = timed(lambda: trained_cifar_operator(cifar_rounds, inputs))
        big, big_t = timed(lambda: top_eigenvalues(trained_op, k_large, seed=0))
        say(f"    MAN CIFAR CNN trained {cifar_rounds} rounds on digits upsampled to 3x32x32 (reduced scale, test acc "
            f"{acc:.3f}, {train_t:.0f} s), {inputs} of its training inputs: {big.hvps} HVPs = "
            f"{big.hvps / k_large:.2f} per eigenvalue ({big_t:.1f} s), all converged: {bool(big.converged.all())}, "
            f"restarts {big.info['restarts']}, lambda_1 = {big.eigenvalues[0]:.4g}, lambda_{k_large} = "
            f"{big.eigenvalues[-1]:.4g}, max residual / lambda {np.max(big.residuals / np.abs(big.eigenvalues)):.1e}")
    if op is not None:
        big, big_t = timed(lambda: top_eigenvalues(op, k_large, seed=0))
        say(f"    random-weight CNN, random inputs (sections 1-3): {big.hvps} HVPs = {big.hvps / k_large:.2f} per "
            f"eigenvalue ({big_t:.1f} s), all converged: {bool(big.converged.all())}, restarts "
            f"{big.info['restarts']}, lambda_{k_large} = {big.eigenvalues[-1]:.4g}; agrees with the reference top "
            f"{k}: max relative difference {max_rel_error(big.eigenvalues[:k], reference):.1e}")

    if digits is not None:
        trained, trained_t = timed(lambda: top_eigenvalues(digits, k_large, tol=1e-4, seed=0))
        lin_d = spla.LinearOperator(
            (digits.dim, digits.dim), dtype=np.float64,
            matvec=lambda u: digits.matvec(torch.from_numpy(np.ascontiguousarray(u, dtype=np.float32).ravel()))
            .double().numpy(),
        )
        before = digits.hvps
        ref_d = np.sort(spla.eigsh(lin_d, k=k_large, which="LA", tol=1e-6,
                                   v0=np.random.default_rng(0).standard_normal(digits.dim))[0])[::-1]
        say(f"    trained digits CNN ({digits.dim:,} parameters, {digits_rounds} rounds, 512 samples): top {k_large} "
            f"at tol 1e-4 with {trained.hvps} HVPs = {trained.hvps / k_large:.2f} per eigenvalue ({trained_t:.1f} s), max "
            f"relative error {max_rel_error(trained.eigenvalues, ref_d):.1e}; eigsh tol 1e-6 needed "
            f"{digits.hvps - before} HVPs = {(digits.hvps - before) / k_large:.2f} per eigenvalue")


def section_trace(op, model, x, y, budget, digits, PyHessian, counter):
    # 5. trace at an equal HVP budget ---------------------------------------------------------------------------
    hutch, hutch_t = timed(lambda: hutchinson_trace(op, rtol=None, max_hvps=budget, seed=0))
    hpp, hpp_t = timed(lambda: hutchpp_trace(op, max_hvps=budget, seed=0))
    torch.manual_seed(0)
    ph = PyHessian(copy.deepcopy(model), nn.CrossEntropyLoss(), data=(x, y), cuda=False)
    counter.take()
    ph_samples, ph_tr_t = timed(lambda: ph.trace())
    counter.take()
    ph_se = np.std(ph_samples, ddof=1) / np.sqrt(len(ph_samples)) if len(ph_samples) > 1 else float("nan")
    say(f"\n[5] trace, {budget} HVPs each: Hutchinson {hutch.estimate:.4g} +- {hutch.stderr:.3g} ({hutch_t:.1f} s); "
        f"Hutch++ {hpp.estimate:.4g} +- {hpp.stderr:.3g} ({hpp_t:.1f} s); stderr ratio Hutchinson / Hutch++ = "
        f"{hutch.stderr / hpp.stderr:.2f}")
    say(f"    PyHessian trace rule: {np.mean(ph_samples):.4g} after {len(ph_samples)} samples ({ph_tr_t:.1f} s), "
        f"reported without an error bar; its samples' standard error would be {ph_se:.3g}")
    if digits is not None:
        d_hutch = hutchinson_trace(digits, rtol=None, max_hvps=budget, seed=0)
        d_hpp = hutchpp_trace(digits, max_hvps=budget, seed=0)
        say(f"    trained digits CNN, {budget} HVPs each: Hutchinson {d_hutch.estimate:.4g} +- {d_hutch.stderr:.3g}; "
            f"Hutch++ {d_hpp.estimate:.4g} +- {d_hpp.stderr:.3g}; stderr ratio = {d_hutch.stderr / d_hpp.stderr:.2f}")


if __name__ == "__main__":
    sys.exit(main())
