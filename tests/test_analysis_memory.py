"""An analysis keeps nothing alive once it is done: the first-order graphs a Hessian operator keeps between products
(and the one it builds to size its blocks) are freed with the operator. The independent truth: weak references to
the network's activations, taken by a forward hook, which die only when no graph holds them.

Counting the bytes of a kept graph with a ``saved_tensors_hooks`` pack hook that returns the tensor itself made every
node that saves its own output (a ReLU, a softmax) hold that output strongly, a reference cycle through torch's C++
graph that Python's garbage collector cannot break: every analysis then left its graphs in memory until the process
ended (about 0.5 GB an analysis of the fmnist-cnn preset)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from flatfl.analysis import HessianOperator
from flatfl.analysis.estimators.eigen import top_eigenvalues
from flatfl.analysis.operators.products import saved_bytes_of

pytestmark = pytest.mark.usefixtures("one_thread")


def network_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5),
                          nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(40, 1, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (40,))
    return model, [(x[:20], y[:20]), (x[20:], y[20:])]


@pytest.mark.parametrize("products", ["double-backward", "forward-over-reverse"])
def test_an_operators_graphs_die_with_it(products):
    model, batches = network_and_data()
    alive = []
    for module in (model[1], model[4]):  # ReLU and Tanh save their own outputs
        module.register_forward_hook(lambda m, i, out: alive.append(weakref.ref(out)))
    op = HessianOperator(model, batches, products=products, cache_graph="auto", block_size=None)
    result = top_eigenvalues(op, 2, tol=1e-6, seed=0)
    if products == "forward-over-reverse":
        op.product_method().block_limit()  # the pass that sizes the blocks builds a graph too
    assert result.converged.all() and alive
    del op
    gc.collect()
    assert [r() for r in alive].count(None) == len(alive), "an activation outlived the analysis"


def test_the_bytes_of_a_graph_are_its_saved_activations():
    """The count walks the graph: a network saving known tensors gives their sizes, parameters excluded."""
    w = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(11, 7, dtype=torch.float64)
    h = torch.tanh(x @ w)  # mm saves x (the weight is a parameter); tanh saves its 11 x 5 output
    loss = (h ** 2).sum()  # pow saves h again (the same storage)
    assert saved_bytes_of([loss], [w]) == 11 * 7 * 8 + 11 * 5 * 8
