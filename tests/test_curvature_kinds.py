"""The curvature base and its registry: the Hessian, the GGN and the empirical Fisher are sibling kinds of
``LossCurvature``, found without torch and named by one entry each; a new kind is one decorated class, which the
settings, the dispatch and the PyHessian-style API take at once; an unknown name is one line listing the registered
ones, before any data is read; the contract's rules (a sum over samples, randomness per sample from the seed) hold
for every registered kind and for a kind that draws labels from the model, against dense matrices built here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from flatfl.analysis import EmpiricalFisherOperator, GGNOperator, HessianOperator, LossCurvature, hessian
from flatfl.analysis.commands.hessian_settings import HessianSettings, measured_text
from flatfl.analysis.operators import kinds
from flatfl.analysis.operators.curvatures import PerSampleGradients
from flatfl.analysis.operators.distributed import DistributedOperator, shard_batches, shard_ranges
from flatfl.analysis.operators.kinds import (CURVATURE_NAMES, CURVATURE_TITLES, CURVATURES, curvature_kind, kind_of,
                                             register_curvature, unregister_curvature)
from flatfl.analysis.operators.linear_operator import FunctionOperator
from flatfl.analysis.operators.loss_curvature import curvature_operator
from flatfl.errors import ConfigError
from sampled_fisher import SampledFisherOperator, registered
from test_curvatures import Flat

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BUILT_IN = {"hessian": HessianOperator, "ggn": GGNOperator, "empirical-fisher": EmpiricalFisherOperator}


def problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(13, 4, generator=g, dtype=torch.float64), torch.arange(13) % 3
    return model, [(x[:5], y[:5]), (x[5:], y[5:])]


def block(dim: int, k: int = 3) -> torch.Tensor:
    return torch.randn(dim, k, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def test_the_built_in_kinds_are_siblings_named_by_one_entry_each():
    assert list(CURVATURES) == list(BUILT_IN)  # the Hessian first (the default), then in their modules' order
    assert dict(CURVATURE_TITLES) == {"hessian": "Hessian", "ggn": "GGN", "empirical-fisher": "empirical Fisher"}
    assert dict(CURVATURE_NAMES) == {"hessian": "Hessian", "ggn": "Gauss-Newton matrix",
                                     "empirical-fisher": "empirical Fisher"}
    for name, cls in BUILT_IN.items():
        kind = CURVATURES[name]
        assert kind.load() is cls and cls.curvature == name and issubclass(cls, LossCurvature)
        assert kind.description and kind.takes_products == (name == "hessian")
        assert not any(issubclass(cls, other) for other in BUILT_IN.values() if other is not cls)


def test_the_sources_declare_what_the_imported_modules_register():
    """The command line lists the kinds from the modules' sources; importing them registers the same entries."""
    declared = kinds.builtin_kinds()
    assert [k.name for k in declared] == list(CURVATURES)
    for kind in declared:
        registered_kind = CURVATURES[kind.name]
        assert kind.path == registered_kind.path and isinstance(kind.operator, str)
        assert all(getattr(kind, f) == getattr(registered_kind, f) for f in ("title", "full_name", "description",
                                                                             "takes_products"))


def test_the_names_are_read_without_torch():
    code = ("import sys\nfrom flatfl.analysis.operators.kinds import CURVATURES, CURVATURE_TITLES, kind_of\n"
            "print(list(CURVATURES), CURVATURE_TITLES['ggn'], kind_of('empirical-fisher').full_name, "
            "'torch' in sys.modules)")
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['hessian', 'ggn', 'empirical-fisher'] GGN empirical Fisher False"


def test_a_declaration_is_read_from_literals_only():
    source = ('@curvature_kind("k", title="K", full_name="a K", description="one line")\nclass K(LossCurvature):\n'
              '    pass\n')
    assert list(kinds.declared_in("pkg.mod", source)) == [
        ("pkg.mod:K", {"name": "k", "title": "K", "full_name": "a K", "description": "one line"})]
    with pytest.raises(ConfigError, match=r"^pkg.mod:K: @curvature_kind takes its name and fields as literals"):
        list(kinds.declared_in("pkg.mod", source.replace('"K"', "TITLE")))


def test_a_new_kind_is_one_decorated_class():
    """Registered by its decorator: the settings, the dispatch, the titles and the PyHessian-style API take it;
    its products are its own (here the per-sample gradients' outer products, as the empirical Fisher's)."""
    model, batches = problem()
    try:
        @curvature_kind("outer-products", title="outer products", full_name="mean outer product",
                        description="(1/N) sum_i g_i g_i^T, for the test")
        class OuterProducts(LossCurvature):
            def product_method(self):
                self.terms.second_order = False
                return PerSampleGradients(self.terms, self.block_size, None, self.cache_bytes)

        assert list(CURVATURES)[-1] == "outer-products" and OuterProducts.curvature == "outer-products"
        HessianSettings(curvature="outer-products").validate()
        assert measured_text("outer-products") == "outer products"
        op = curvature_operator("outer-products", model, batches)
        V = block(op.dim)
        assert torch.allclose(op.matmat(V), EmpiricalFisherOperator(model, batches).matmat(V), rtol=1e-12, atol=0)
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        assert isinstance(hessian(model, data=(x, y), curvature="outer-products").operator, OuterProducts)
        with pytest.raises(ConfigError, match="the outer-products curvature has products of its own"):
            HessianSettings(curvature="outer-products", products="finite-difference").validate()
        with pytest.raises(ConfigError, match="already registered"):
            register_curvature("ggn", OuterProducts, title="t", full_name="f", description="d")
    finally:
        unregister_curvature("outer-products")
    with pytest.raises(ConfigError, match="^unknown curvature 'outer-products'"):
        HessianSettings(curvature="outer-products").validate()


def test_an_unknown_curvature_is_one_line_listing_the_registered_ones_before_any_data_is_read():
    listed = "^unknown curvature 'fisher': choose one of hessian, ggn, empirical-fisher$"
    with pytest.raises(ConfigError, match=listed):
        kind_of("fisher")
    with pytest.raises(ConfigError, match=listed):
        HessianSettings(curvature="fisher").validate()
    model, _ = problem()

    def unread():
        raise AssertionError("the data was read")
        yield

    with pytest.raises(ConfigError, match=listed):
        hessian(model, dataloader=unread(), curvature="fisher")
    with pytest.raises(ConfigError, match=listed):
        curvature_operator("fisher", model, unread())


@pytest.mark.parametrize("curvature", list(CURVATURES))
def test_every_kind_is_the_sample_weighted_sum_of_its_shards(curvature):
    """The contract's point 2, in one process: the operators of 3 shards (cut inside batches), weighted by their
    samples, give the whole set's products to 1e-12 (what the ranks compute)."""
    model, batches = problem()
    whole = curvature_operator(curvature, model, batches)
    V = block(whole.dim)
    total = torch.zeros(whole.dim, V.shape[1], dtype=torch.float64)
    for rank, (start, _) in enumerate(shard_ranges([5, 8], 3)):
        shard = curvature_operator(curvature, model, shard_batches(batches, rank, 3))
        shard.as_shard(lambda t: t, start)
        total += shard.matmat(V) * (shard.num_samples / whole.num_samples)
    assert torch.allclose(total, whole.matmat(V), rtol=0, atol=1e-12 * float(whole.matmat(V).abs().max()))


def dense_sampled_fisher(op: SampledFisherOperator, model, x) -> np.ndarray:
    """(1/N) sum_i g_i g_i^T, g_i the gradient of sample i's cross-entropy at the label drawn from softmax(model(x_i))
    by the operator's generator of sample i (torch.autograd.functional.jacobian over the flat parameters)."""
    flat = Flat(model)
    rows = []
    for i in range(len(x)):
        probs = torch.softmax(model(x[i:i + 1])[0].detach(), dim=0)
        rows.append(flat.sample_gradient(x[i], int(torch.multinomial(probs, 1, generator=op.sample_generator(i)))))
    G = torch.stack(rows)
    return (G.T @ G / len(x)).numpy()


def test_a_kind_that_draws_random_numbers_is_one_fixed_map_whatever_the_split():
    """The sampled-label Fisher (tests/sampled_fisher.py), labels drawn per sample from the seed: the dense matrix
    of those labels to 1e-12; the same products call after call, and one vector at a time to rounding; another seed,
    another map;
    and a shard that knows its first sample draws the whole set's labels for its samples."""
    model, batches = problem()
    x = torch.cat([b[0] for b in batches])
    with registered() as name:
        op = curvature_operator(name, model, batches, seed=7)
        assert isinstance(op, SampledFisherOperator) and op.seed == 7
        V = block(op.dim, 4)
        dense = dense_sampled_fisher(op, model, x)
        P = op.matmat(V)
        assert np.allclose(P.numpy(), dense @ V.numpy(), rtol=0, atol=1e-12 * float(np.abs(dense).max()))
        assert torch.equal(op.matmat(V), P)
        one_by_one = torch.cat([op.matmat(V[:, j:j + 1]) for j in range(4)], dim=1)
        assert torch.allclose(one_by_one, P, rtol=0, atol=1e-14 * float(P.abs().max()))  # the same map to rounding
        assert not torch.allclose(curvature_operator(name, model, batches, seed=8).matmat(V), P)
        tail = curvature_operator(name, model, shard_batches(batches, 1, 2), seed=7)
        tail.as_shard(lambda t: t, 7)  # samples 7..12 of the whole set
        assert [int(tail.sample_generator(i).initial_seed()) for i in range(6)] == \
            [int(op.sample_generator(7 + i).initial_seed()) for i in range(6)]


def test_randomness_is_drawn_per_sample_or_not_at_all():
    """The contract's point 3: a kind declaring another randomness is refused where it is defined, and an operator
    that declares one is refused by the operator over ranks."""
    with pytest.raises(ConfigError, match=r"^the curvature Free declares randomness = 'global'; a curvature is one "
                                          r"fixed map"):
        class Free(LossCurvature):
            randomness = "global"

    op = FunctionOperator(lambda v: v, 3, torch.float64)
    op.randomness = "global"
    with pytest.raises(ConfigError, match=r"^FunctionOperator declares randomness = 'global': over several ranks"):
        DistributedOperator(op, 3)
