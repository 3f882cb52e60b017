"""Test support: jobs that run the same way in one process and as several ranks (``tests/ranks.py`` starts them as
ranks: ``python tests/rank_jobs.py JOB OUT``); each rank saves what it computed to ``OUT.rank<R>.pt``, and the test
compares every rank's file with the job run in the test's own process.

* ``estimators``: every registered eigenvalue, trace and density estimator, the per-layer blocks, the
  PyHessian-style API and a ``loss=`` objective over dict batches, on a small float64 network whose 37 evaluation
  samples do not divide among 2 or 3 ranks (unequal shards);
* ``curvatures``: every registered curvature kind (``curvature_cases``, read off the registry: the Hessian by each
  of its product methods, exact and finite differences) and the sampled-label Fisher of ``tests/sampled_fisher.py``
  (a kind that draws random numbers), each on :func:`problem`: a block of products, the loss and gradient, a top
  eigenvalue (and that of the curvature + I/4), a trace and every registered measured quantity of a fixed budget,
  and for finite differences the step and the stated error;
* ``training``: a case of every registered algorithm, regularizer and local optimizer (``training_cases``, read off
  the registries), trained for its rounds in float64 with each rank stacking its share of a round's clients.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from combinations import Combination, _cost, admitted, factors, train_case  # noqa: E402

from flatfl.train.components import ALGORITHMS  # noqa: E402

SAMPLES, BATCH = 37, 8


def problem():
    """A small float64 network and its evaluation batches (the same in every process)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
        x = torch.randn(SAMPLES, 6, dtype=torch.float64)
        y = torch.randint(0, 3, (SAMPLES,))
    batches = [(x[a:a + BATCH], y[a:a + BATCH]) for a in range(0, SAMPLES, BATCH)]
    return model, batches


def dict_loss(model, batch):
    return nn.functional.cross_entropy(model(batch["inputs"]), batch["labels"])


def estimator_results() -> dict:
    """Every registered estimator's numbers on :func:`problem` (torch tensors and floats, by name)."""
    from flatfl.analysis import hessian
    from flatfl.analysis.operators.distributed import over_ranks
    from flatfl.analysis.estimators.by_name import estimate_density, estimate_eigenvalues, estimate_trace
    from flatfl.analysis.operators.curvatures import GGNOperator
    from flatfl.analysis.operators.hessian import HessianOperator
    from flatfl.analysis.estimators.per_layer import per_layer_curvature
    from flatfl.errors import ConfigError
    from flatfl.utils import ranks
    from flatfl.analysis.estimators.registry import estimator_names

    ranks.join(torch.device("cpu"))
    model, batches = problem()
    op = over_ranks(lambda shard: HessianOperator(model, shard), batches)
    out = {"dim": op.dim, "loss": op.loss(), "gradient": op.gradient()}
    for name in estimator_names("eigenvalues"):
        r = estimate_eigenvalues(op, name, 3, tol=1e-8, seed=0, return_vectors=True)
        out[f"eigenvalues {name}"] = torch.as_tensor(r.eigenvalues)
        out[f"eigenvectors {name}"] = (torch.as_tensor(r.eigenvectors) * torch.sign(
            torch.as_tensor(r.eigenvectors)[:, :1])).clone()
    ggn = over_ranks(lambda shard: GGNOperator(model, shard), batches)
    for name in estimator_names("trace"):
        try:
            r = estimate_trace(op, name, max_hvps=30, rtol=None, seed=1)
        except ConfigError:  # the exact trace: this tanh network's Hessian has none (exact_trace.py), its GGN has
            r = estimate_trace(ggn, name, max_hvps=30, rtol=None, seed=1)
        out[f"trace {name}"] = torch.tensor([float(r.estimate)] + [float(s) for s in r.samples])
    for name in estimator_names("density"):
        r = estimate_density(op, name, steps=8, starts=2, seed=2)
        out[f"density {name}"] = torch.cat([torch.as_tensor(v).reshape(-1) for v in (*r.nodes, *r.weights)])
    layers = per_layer_curvature(op, 2, seed=3, trace_hvps=20, trace_rtol=None, dense_up_to=0)
    out["per-layer"] = torch.tensor([v for b in layers.as_dict()["blocks"] for v in
                                     (*b["top_eigenvalues"], b["trace"])], dtype=torch.float64)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    h = hessian(model, nn.CrossEntropyLoss(), data=(x, y))
    values, _ = h.eigenvalues(top_n=2, tol=1e-8)
    out["api eigenvalues"] = torch.tensor(values)
    out["api trace"] = torch.tensor(h.trace(maxIter=20, tol=1e-12))
    dict_batches = [{"inputs": a, "labels": b} for a, b in batches]
    objective = over_ranks(lambda shard: HessianOperator(model, shard, loss=dict_loss), dict_batches, objective=True)
    out["objective eigenvalues"] = torch.as_tensor(estimate_eigenvalues(objective, "lanczos", 2, tol=1e-8).eigenvalues)
    out["hvps"] = op.hvps
    return out


def curvature_cases() -> list[tuple[str, str]]:
    """``(curvature, products)`` for every registered curvature kind: a kind that takes ``products`` (the Hessian)
    by each of its product methods, exact and finite differences; the others by their own (``"auto"``)."""
    from flatfl.analysis.operators.kinds import CURVATURES
    from flatfl.analysis.operators.names import PRODUCT_METHODS

    return [(name, products) for name, kind in CURVATURES.items()
            for products in ([m for m in PRODUCT_METHODS if m != "auto"] if kind.takes_products else ["auto"])]


def curvature_results() -> dict:
    """Each case of :func:`curvature_cases` (with the sampled-label Fisher registered) on :func:`problem`, by
    ``"<curvature> <products> <what>"``."""
    from flatfl.analysis.estimators.eigen import top_eigenvalues
    from flatfl.analysis.commands.hessian_settings import HessianSettings
    from flatfl.analysis.estimators.quantities import quantity, quantity_names
    from flatfl.analysis.estimators.trace import hutchinson_trace
    from flatfl.analysis.operators.combined import damped
    from flatfl.analysis.operators.distributed import over_ranks
    from flatfl.analysis.operators.loss_curvature import curvature_operator
    from flatfl.utils import ranks
    from sampled_fisher import registered

    ranks.join(torch.device("cpu"))
    model, batches = problem()
    out = {}
    with registered():
        for name, products in curvature_cases():
            op = over_ranks(lambda shard: curvature_operator(name, model, shard, products=products, seed=7), batches)
            V = torch.randn(op.dim, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
            key = f"{name} {products}"
            out[f"{key} products"] = op.matmat(V / V.norm(dim=0))
            out[f"{key} loss"] = torch.tensor(op.loss())
            out[f"{key} gradient"] = op.gradient()
            out[f"{key} top eigenvalue"] = torch.as_tensor(top_eigenvalues(op, 1, tol=1e-8, seed=1).eigenvalues)
            damped_top = top_eigenvalues(damped(op, 0.25), 1, tol=1e-8, seed=1).eigenvalues  # the curvature + I/4
            out[f"{key} damped top eigenvalue"] = torch.as_tensor(damped_top)
            out[f"{key} trace"] = torch.tensor(float(hutchinson_trace(op, max_hvps=8, rtol=None, seed=2).estimate))
            for measured in quantity_names():  # every registered quantity, within a budget of 8 products
                record = quantity(measured).measure(op, HessianSettings(trace_hvps=8, trace_rtol=None), 3)
                out[f"{key} {measured}"] = torch.tensor(float(record["estimate"]))
            if op.product_error is not None:
                method = getattr(op, "op", op).method  # this rank's operator's product method
                out[f"{key} stated error"] = torch.tensor(op.product_error, dtype=torch.float64)
                out[f"{key} step factor"] = torch.tensor(method.factor, dtype=torch.float64)
    return out


def training_cases() -> list[Combination]:
    """A case of every registered algorithm (no regularizer, its own or the plain optimizer), every regularizer
    (FedAvg) and every local optimizer (FedAvg, no regularizer), each on the cheapest model that admits it."""
    models, regs, algos, opts = factors()
    by_cost = sorted(models, key=_cost)
    cases = []

    def first(reg, algo, opt):
        for model in by_cost:
            c = Combination(model, reg, algo, opt)
            if admitted(c):
                return c
        return None

    for algo in algos:
        own = ALGORITHMS.get_class(algo).local_opt
        cases.append(first("none", algo, own or "sgd"))
    cases += [first(reg, "fedavg", "sgd") for reg in regs if reg != "none"]
    cases += [first("none", "fedavg", opt) for opt in opts if opt != "sgd"]
    return [c for c in dict.fromkeys(cases) if c is not None]


def trained_state(tr) -> dict:
    """What a trained case holds: the server model, every client's latest model, the buffers, the algorithm's
    state (on the CPU)."""
    return {"theta": tr.theta.cpu(), "latest": tr.latest.cpu(),
            "buffers": {k: v.cpu() for k, v in tr.buffers.items()},
            "latest_buffers": {k: v.cpu() for k, v in tr.latest_buffers.items()},
            "server": {k: v.cpu() for k, v in tr.algo.server.items()},
            "clients": {k: v.cpu() for k, v in tr.algo.clients.items()}}


def training_results(where: Path, parallel="all") -> dict:
    return {c.label: trained_state(train_case(c, where / c.label, parallel)) for c in training_cases()}


def main(argv: list[str]) -> None:
    from flatfl.utils import ranks

    job, out = argv[0], Path(argv[1])
    torch.set_num_threads(1)
    rank = ranks.launched().rank
    if job == "estimators":
        result = estimator_results()
    elif job == "curvatures":
        result = curvature_results()
    elif job == "training":
        result = training_results(out.parent / f"runs-rank{rank}")
    else:
        raise SystemExit(f"unknown job {job!r}")
    torch.save(result, f"{out}.rank{rank}.pt")
    ranks.leave()


if __name__ == "__main__":
    main(sys.argv[1:])
