"""Does the differential test still catch what it was written to catch? Each deliberate break of the stacked
("together") path, applied by monkeypatching, and a few of the differential cases run through the test's own checker.

``tests/test_every_path.py`` trains each case once with clients one at a time and once with a round's clients
stacked, and compares everything they hold within 1e-9 relative in float64 (``check_case`` of
``tests/combinations.py``, the function the test asserts on). Its cases train flatfl's ResNets at slim widths
(``CASE_MODEL_ARGS``); this script shows that the check on those cases still fails for each break of the stacked
path, and passes on each case without it. Not a test of the default run (it takes a few minutes on 2 cores):

    python benchmarks/differential_breaks.py            # every break
    python benchmarks/differential_breaks.py --only b d # some of them

The breaks (each applied to the stacked path only, so that one client at a time, the reference, is unchanged):

(a) MAN hooked on the pre-activation: in a stacked network MAN penalises the input of each activation module (a
    forward pre-hook: the ResNet block's sum before its output ReLU, the Linear's output before the MLP's ReLU)
    instead of its post-ReLU output (``MAN.attach``);
(b) one client's gradient x (1 + 1e-6): the first stepping client's row of every gradient of a stacked step, before
    the algorithm's correction, clipping and the SGD update (``LocalOptimizer.descend``). Clipping to a norm
    (``--clip``, 10 by default) undoes a uniform scale of a clipped gradient, so a case whose every client is
    clipped at every step cannot show this break, at any width (``INVISIBLE``: ResNet-56's one-step case);
(c) client state x (1 + 1e-6): the algorithm's per-client state rows (FedDyn's h, SCAFFOLD's c) of the clients of a
    stacked cohort, once the cohort has trained (``RoundLoop.run_cohort``);
(d) BatchNorm momentum x (1 + 1e-3): every stacked BatchNorm (``StackedBatchNorm2d``) of a stacked network, through
    the stacking hooks (``flatfl.models.stacking.STACKING_HOOKS``);
(e) a shard's sample weight dropped in the distributed sum: :class:`~flatfl.analysis.operators.distributed.
    DistributedOperator` weighting each rank's curvature by 1/R instead of n_r/N. That one is about ranks, not
    stacking; ``tests/test_distributed.py::test_every_estimator_over_ranks_equals_one_process`` would show it (real
    gloo ranks, 37 samples over 2 and 3 ranks: unequal shards, 1e-12; its ranks are processes of their own, so it is
    not run broken here: the break moves the products by about 3e-2). Here the ranks are simulated in this process:
    one operator per shard, their all-gather of the shard sizes answered with the sizes and their all-reduce taken
    as the sum of their scaled products, compared with one process's operator on every sample by that test's
    ``_close`` at 1e-12 (the product H V, the loss and the gradient).

Printed on a 2-core machine (torch 2.13.0+cpu, shared with other jobs at a load average of about 4; the seconds
are wall time under that load):

torch 2.13.0+cpu, 2 threads; check: combinations.check_case (rtol 1e-09)
the cases' model_args: resnet18 {'widths': [4, 8, 8, 8]}; resnet20 {'widths': [4, 8, 8]}; resnet56 {'widths': [4, 8, 8]}
(a) MAN hooked on the pre-activation instead of the post-ReLU activation, stacked path only
    resnet18-man-fedavg-sgd
        intact: passes, largest difference 5.8e-16 (buffer layer4.0.shortcut.1.running_var), 16.0 s
        broken: CAUGHT, largest difference 2.9e-02 (buffer layer4.0.shortcut.1.running_var), 3.7 s
    resnet20-man-fedrobust-sam
        intact: passes, largest difference 1.2e-15 (client state delta), 5.7 s
        broken: CAUGHT, largest difference 4.1e-01 (client state delta), 16.0 s
    resnet56-man-fedprox-sam
        intact: passes, largest difference 1.1e-14 (clients' buffer layer3.5.norm2.running_mean), 10.8 s
        broken: CAUGHT, largest difference 3.7e-02 (clients' buffer layer3.5.norm2.running_mean), 8.1 s
    mlp-man-feddisco-sgd
        intact: passes, largest difference 2.0e-16 (server weights), 0.3 s
        broken: CAUGHT, largest difference 1.2e-03 (clients' latest models), 0.6 s
(b) one client's gradient x (1 + 1e-6), stacked path only
    resnet18-none-fedavg-sgd
        intact: passes, largest difference 7.3e-16 (buffer layer4.0.shortcut.1.running_var), 1.7 s
        broken: CAUGHT, largest difference 7.9e-08 (buffer layer4.0.shortcut.1.running_var), 2.9 s
    resnet20-gradaug-fedavg-sgd
        intact: passes, largest difference 5.4e-16 (clients' buffer layer3.0.norm1.running_var), 25.3 s
        broken: CAUGHT, largest difference 2.8e-08 (buffer stem_norm.running_mean), 17.2 s
    resnet56-stochdepth-fedavg-sgd
        intact: passes, largest difference 8.9e-17 (clients' latest models), 9.5 s
        broken: no trace, as expected, largest difference 2.3e-16 (clients' latest models), 12.4 s
        its one step a round clips every client's gradient (norms above 10, the --clip default) to
        norm 10, which undoes a uniform scale of the gradient; so at the default widths too
    digits-cnn-none-scaffold-sgd
        intact: passes, largest difference 7.2e-15 (server state c), 1.9 s
        broken: CAUGHT, largest difference 6.4e-07 (server state c), 1.8 s
(c) client state x (1 + 1e-6), stacked path only
    resnet20-stochdepth-feddyn-asam
        intact: passes, largest difference 1.3e-14 (client state h), 5.4 s
        broken: CAUGHT, largest difference 1.6e-06 (client state h), 6.7 s
    resnet20-gradaug-scaffold-sgd
        intact: passes, largest difference 1.4e-14 (server state c), 18.6 s
        broken: CAUGHT, largest difference 1.0e-06 (client state c), 6.9 s
    resnet56-gradaug-feddyn-sam
        intact: passes, largest difference 5.1e-12 (client state h), 24.6 s
        broken: CAUGHT, largest difference 1.0e-06 (client state h), 13.4 s
    digits-cnn-none-scaffold-sgd
        intact: passes, largest difference 7.2e-15 (server state c), 1.9 s
        broken: CAUGHT, largest difference 1.9e-06 (server state c), 0.5 s
(d) BatchNorm momentum x (1 + 1e-3), stacked path only
    resnet18-none-fedavg-sgd
        intact: passes, largest difference 7.3e-16 (buffer layer4.0.shortcut.1.running_var), 1.7 s
        broken: CAUGHT, largest difference 1.0e-03 (clients' buffer stem_norm.running_mean), 1.3 s
    resnet20-gradaug-fedavg-sgd
        intact: passes, largest difference 5.4e-16 (clients' buffer layer3.0.norm1.running_var), 25.3 s
        broken: CAUGHT, largest difference 1.0e-03 (clients' buffer stem_norm.running_mean), 11.6 s
    resnet56-stochdepth-fedavg-sgd
        intact: passes, largest difference 8.9e-17 (clients' latest models), 9.5 s
        broken: CAUGHT, largest difference 1.0e-03 (buffer stem_norm.running_mean), 19.4 s
(e) a shard's sample weight dropped in the distributed sum (each shard weighted 1/R, not n_r/N)
    2 and 3 simulated ranks, 37 samples
        intact: passes, largest difference 3.3e-16 (H V, loss, gradient), 0.1 s
        broken: CAUGHT, largest difference 2.8e-02 (H V, loss, gradient), 0.1 s
every break caught, every case passes intact (243 s)
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import combinations  # noqa: E402
from combinations import Combination, check_case  # noqa: E402
from external_algorithm import registered  # noqa: E402

from flatfl.errors import ConfigError  # noqa: E402

#: each break: (what it does, the cases it is checked on); every case is one of the test's (a slim ResNet where
#: the case is a ResNet) and each break has at least one slim ResNet case
BREAKS = {
    "a": ("MAN hooked on the pre-activation instead of the post-ReLU activation, stacked path only",
          ["resnet18-man-fedavg-sgd", "resnet20-man-fedrobust-sam", "resnet56-man-fedprox-sam",
           "mlp-man-feddisco-sgd"]),
    "b": ("one client's gradient x (1 + 1e-6), stacked path only",
          ["resnet18-none-fedavg-sgd", "resnet20-gradaug-fedavg-sgd", "resnet56-stochdepth-fedavg-sgd",
           "digits-cnn-none-scaffold-sgd"]),
    "c": ("client state x (1 + 1e-6), stacked path only",
          ["resnet20-stochdepth-feddyn-asam", "resnet20-gradaug-scaffold-sgd", "resnet56-gradaug-feddyn-sam",
           "digits-cnn-none-scaffold-sgd"]),
    "d": ("BatchNorm momentum x (1 + 1e-3), stacked path only",
          ["resnet18-none-fedavg-sgd", "resnet20-gradaug-fedavg-sgd", "resnet56-stochdepth-fedavg-sgd"]),
    "e": ("a shard's sample weight dropped in the distributed sum (each shard weighted 1/R, not n_r/N)", []),
}

#: (break, case) pairs where the break leaves no trace in the numbers, and why (printed, not counted as a miss)
INVISIBLE = {
    ("b", "resnet56-stochdepth-fedavg-sgd"): "its one step a round clips every client's gradient (norms above 10, "
    "the --clip default) to norm 10, which undoes a uniform scale of the gradient; so at the default widths too",
}

SCALE = 1 + 1e-6


def combination(label: str) -> Combination:
    """The case of a label ``model-reg-algo-opt`` (a model name may hold a dash)."""
    model, reg, algo, opt = label.rsplit("-", 3)
    return Combination(model, reg, algo, opt)


# ----- the breaks -----

@contextlib.contextmanager
def patched(owner, name: str, value):
    """``owner.name`` is ``value`` inside the block, what it was after."""
    real = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, real)


@contextlib.contextmanager
def man_on_pre_activation():
    from flatfl.models.stacking import counterparts, source_network, stacked_clients
    from flatfl.train.regularizers import man

    real = man.MAN.attach

    def attach(self, model):
        before = len(self._handles)
        real(self, model)
        if stacked_clients(model) == 1:
            return
        for handle in self._handles[before:]:  # the post-activation hooks just installed on the stacked network
            handle.remove()
        del self._handles[before:]

        def pre(module, inputs):
            a = inputs[0] if inputs else None
            if not (self._recording and isinstance(a, torch.Tensor)):
                return None
            passed_on, term = man.penalised(a, self._clients)
            self._terms.append(term)
            self._watched.append((a, a._version))
            return (passed_on, *inputs[1:])

        for module in counterparts(model, man.default_activation_modules(source_network(model))):
            self._handles.append(module.register_forward_pre_hook(pre))

    with patched(man.MAN, "attach", attach):
        yield


@contextlib.contextmanager
def one_clients_gradient_scaled():
    from flatfl.train import optimizers

    real = optimizers.LocalOptimizer.descend

    def descend(self, correct, rows):
        lay = self.layout
        if lay.n > 1:
            k = 0 if rows is None else int(rows[0])
            with torch.no_grad():
                for p, shape in zip(lay.params, lay.shapes):
                    if p.grad is not None:
                        lay.rows(p.grad, shape)[k].mul_(SCALE)
        real(self, correct, rows)

    with patched(optimizers.LocalOptimizer, "descend", descend):
        yield


@contextlib.contextmanager
def client_state_scaled():
    from flatfl.train import rounds

    real = rounds.RoundLoop.run_cohort

    def train_cohort(self, rctx, ids, lr, augment):
        out = real(self, rctx, ids, lr, augment)
        if len(ids) > 1:
            with torch.no_grad():
                for v in self.algo.clients.values():
                    if v.is_floating_point():
                        index = torch.tensor(ids, device=v.device)
                        v[index] = v[index] * SCALE
        return out

    with patched(rounds.RoundLoop, "run_cohort", train_cohort):
        yield


@contextlib.contextmanager
def batchnorm_momentum_scaled():
    from flatfl.models import stacking

    def hook(stacked, n):
        for m in stacked.modules():
            if isinstance(m, stacking.StackedBatchNorm2d) and m.momentum is not None:
                m.momentum *= 1 + 1e-3

    stacking.STACKING_HOOKS.append(hook)
    try:
        yield
    finally:
        stacking.STACKING_HOOKS.remove(hook)


@contextlib.contextmanager
def shard_weight_dropped():
    from flatfl.analysis.operators import distributed

    real = distributed.DistributedOperator.__init__

    def init(self, local, num_samples):
        real(self, local, num_samples)
        self.scale = 1.0 / len(self.shard_samples)

    with patched(distributed.DistributedOperator, "__init__", init):
        yield


APPLY = {"a": man_on_pre_activation, "b": one_clients_gradient_scaled, "c": client_state_scaled,
         "d": batchnorm_momentum_scaled, "e": shard_weight_dropped}


# ----- the checks -----

def run_check(c: Combination) -> tuple[list[str], float, str]:
    """``check_case`` of the case: (its failures, seconds, the largest difference it measured, named)."""
    seen = []
    real = combinations.differences

    def recording(reference, other):
        out = real(reference, other)
        seen.append(out)
        return out

    combinations.differences = recording  # check_case reads it from its module: the values it compared
    t = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as d:
            failures = check_case(c, Path(d))
    except ConfigError as e:
        failures = [f"refused before training: {e}"]
    finally:
        combinations.differences = real
    worst = ""
    if seen:
        name, value = max(((k, v) for out in seen for k, v in out.items()), key=lambda kv: kv[1])
        worst = f"{value:.1e} ({name})"
    return failures, time.perf_counter() - t, worst


def distributed_check(world_sizes=(2, 3)) -> tuple[list[str], float, str]:
    """The curvature over simulated ranks against one process's (module docstring, (e)): (what differs, seconds,
    the largest relative difference)."""
    from rank_jobs import problem
    from test_distributed import _close

    from flatfl.analysis.operators.distributed import DistributedOperator, shard_batches
    from flatfl.analysis.operators.hessian import HessianOperator
    from flatfl.utils import ranks

    t = time.perf_counter()
    model, batches = problem()
    whole = HessianOperator(model, batches)
    v = torch.randn(whole.dim, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    reference = {"H V": whole.matmat(v.clone()), "loss": whole.loss(), "gradient": whole.gradient()}
    failures, worst = [], 0.0
    for world in world_sizes:
        local = [HessianOperator(model, shard_batches(batches, r, world)) for r in range(world)]
        counts = [op.num_samples for op in local]
        saved = ranks.all_gather_objects, ranks.all_reduce_min, ranks.all_reduce_sum
        ranks.all_gather_objects = lambda obj: list(counts)
        ranks.all_reduce_min = int
        ranks.all_reduce_sum = lambda tensor: tensor  # each rank's part; the sum over the ranks is taken below
        try:
            ops = [DistributedOperator(op, n) for op, n in zip(local, counts)]
            got = {"H V": sum(op.matmat(v.clone()) for op in ops), "loss": sum(op.loss() for op in ops),
                   "gradient": sum(op.gradient() for op in ops)}
        finally:
            ranks.all_gather_objects, ranks.all_reduce_min, ranks.all_reduce_sum = saved
        failures += _close(got, reference, 1e-12, f"{world} ranks (shards {counts})")
        for k in reference:
            a, b = torch.as_tensor(got[k]), torch.as_tensor(reference[k])
            worst = max(worst, float((a - b).abs().max() / b.abs().max()))
    return failures, time.perf_counter() - t, f"{worst:.1e} (H V, loss, gradient)"


def verdict(failures: list[str], broken: bool) -> str:
    if broken:
        return "CAUGHT" if failures else "NOT CAUGHT"
    return "passes" if not failures else "FAILS WITHOUT THE BREAK"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(BREAKS), help="run these breaks only")
    args = parser.parse_args(argv)
    torch.set_printoptions(precision=3)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; check: combinations.check_case "
          f"(rtol {combinations.CASE_RTOL:g})")
    print("the cases' model_args: " + "; ".join(f"{m} {a}" for m, a in combinations.CASE_MODEL_ARGS.items()))
    intact: dict[str, tuple] = {}
    bad = 0
    started = time.perf_counter()
    with registered():
        for key in args.only or sorted(BREAKS):
            what, labels = BREAKS[key]
            print(f"({key}) {what}")
            checks = [(label, lambda label=label: run_check(combination(label))) for label in labels]
            if key == "e":
                checks = [("2 and 3 simulated ranks, 37 samples", distributed_check)]
            for label, check in checks:
                if label not in intact:
                    intact[label] = check()
                with APPLY[key]():
                    broken = check()
                invisible = INVISIBLE.get((key, label))
                ok = not intact[label][0] and (bool(broken[0]) or invisible is not None)
                bad += not ok
                shown = verdict(broken[0], True) if broken[0] or invisible is None else "no trace, as expected"
                print(f"    {label}\n        intact: {verdict(intact[label][0], False)}, largest difference "
                      f"{intact[label][2]}, {intact[label][1]:.1f} s\n        broken: {shown}, largest difference "
                      f"{broken[2]}, {broken[1]:.1f} s")
                if invisible is not None and not broken[0]:
                    print("\n".join(textwrap.wrap(invisible, 100, initial_indent=" " * 8, subsequent_indent=" " * 8)))
                elif not ok:
                    print("        " + "; ".join(intact[label][0] or broken[0] or ["nothing reported"])[:600])
    print(f"{'every break caught, every case passes intact' if not bad else f'{bad} check(s) went wrong'} "
          f"({time.perf_counter() - started:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
