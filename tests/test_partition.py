"""Partitions (docs/update-rules.md section 1): sizes, determinism, label skew versus alpha, errors."""
import numpy as np
import pytest

from flatfl.data.partition import make_partition
from flatfl.errors import ConfigError

LABELS = np.repeat(np.arange(10), 100)  # 1,000 samples, 10 balanced classes


def _skew(part):
    counts = part.label_counts(LABELS, 10)
    return (counts.max(1) / counts.sum(1)).mean()


def test_feddyn_dirichlet_equal_sizes_and_disjoint():
    p = make_partition(LABELS, 20, "dirichlet", 0.3, seed=1)
    assert (p.sizes == 50).all()
    allidx = np.concatenate(p.client_indices)
    assert len(np.unique(allidx)) == len(allidx) == 1000


def test_feddyn_dirichlet_does_not_hang_when_classes_run_out():
    # digits-like: 10 classes, 20 clients, delta 0.3 hung a literal re-implementation (spec pitfall)
    labels = np.random.default_rng(0).integers(0, 10, size=1437)
    for seed in range(5):
        p = make_partition(labels, 20, "dirichlet", 0.3, seed=seed)
        assert (p.sizes == 1437 // 20).all()


def test_partition_is_deterministic_given_seed():
    for method in ("dirichlet", "fedml-dirichlet", "iid"):
        a = make_partition(LABELS, 10, method, 0.5, seed=7)
        b = make_partition(LABELS, 10, method, 0.5, seed=7)
        c = make_partition(LABELS, 10, method, 0.5, seed=8)
        assert all((x == y).all() for x, y in zip(a.client_indices, b.client_indices))
        assert any(len(x) != len(y) or (x != y).any() for x, y in zip(a.client_indices, c.client_indices))


@pytest.mark.parametrize("method", ["dirichlet", "fedml-dirichlet"])
def test_label_skew_grows_as_alpha_shrinks(method):
    skews = [np.mean([_skew(make_partition(LABELS, 10, method, a, seed=s)) for s in range(3)])
             for a in (100.0, 1.0, 0.1)]
    assert skews[0] < skews[1] < skews[2]
    assert skews[0] < 0.2 and skews[2] > 0.4


def test_fedml_dirichlet_unbalanced_with_minimum_size():
    p = make_partition(LABELS, 16, "fedml-dirichlet", 0.5, seed=0)
    assert p.sizes.min() >= 10
    assert p.sizes.sum() == 1000
    assert p.sizes.max() > p.sizes.min()


def test_iid_balanced_and_complete():
    p = make_partition(LABELS, 7, "iid", None, seed=0)
    assert p.sizes.max() - p.sizes.min() <= 1 and p.sizes.sum() == 1000
    assert _skew(p) < 0.3


def test_roundtrip_dict():
    from flatfl.data.partition import Partition

    p = make_partition(LABELS, 5, "dirichlet", 0.3, seed=3)
    q = Partition.from_dict(p.to_dict())
    assert all((x == y).all() for x, y in zip(p.client_indices, q.client_indices))


@pytest.mark.parametrize("kwargs,msg", [
    (dict(num_clients=1001, method="iid"), "more clients"),
    (dict(num_clients=10, method="dirichlet", alpha=0.0), "alpha"),
    (dict(num_clients=10, method="dirichlet", alpha=-1.0), "alpha"),
    (dict(num_clients=10, method="nope"), "unknown partition"),
    (dict(num_clients=200, method="fedml-dirichlet", alpha=0.5), "at least 10"),
])
def test_bad_partition_arguments(kwargs, msg):
    with pytest.raises(ConfigError, match=msg):
        make_partition(LABELS, **kwargs)
