"""One walk through every nested batch (flatfl/utils/batch_walk.py): each container kind (dict, OrderedDict, a UserDict
with attributes of its own as Hugging Face's BatchEncoding, namedtuple, dataclass, frozen dataclass, tuple, list and
mixes of them) keeps its type through slicing, counting and moves, and under 2 gloo ranks a Hessian over namedtuple
and UserDict batches with a user's loss equals one process's, each rank holding its share of the samples.

Run as ``python tests/test_batch_walk.py OUT`` (as tests/ranks.py starts the ranks), the file is the ranks' job: each
rank saves its numbers to ``OUT.rank<R>.pt``."""
from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import rank_jobs
from ranks import run_ranks

from flatfl.errors import ConfigError
from flatfl.utils.batch_walk import count_samples, leaves, map_tensors, slice_samples, tensors, to_device

#: 37 samples in batches of 8 (rank_jobs.problem): 19 and 18 over 2 ranks, the third batch cut
SHARES = (19, 18)

Pair = collections.namedtuple("Pair", "inputs labels")


class Encoding(collections.UserDict):
    """A UserDict built from a dict, with attributes of its own and its items as attributes, as Hugging Face's
    BatchEncoding."""

    def __init__(self, data=None, encodings=None) -> None:
        super().__init__(data)
        self.encodings = encodings

    def __getattr__(self, name):
        if name == "data":  # not yet set (a copy in the making)
            raise AttributeError(name)
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclasses.dataclass
class Record:
    inputs: torch.Tensor
    labels: torch.Tensor
    note: str = "kept"


@dataclasses.dataclass(frozen=True)
class Frozen:
    inputs: torch.Tensor
    scale: torch.Tensor
    rows: int = dataclasses.field(init=False, default=-1)


class Strict(Mapping):
    """A Mapping whose type cannot be built from a dict: rebuilt as a plain dict."""

    def __init__(self, *, items) -> None:
        self.items_ = dict(items)

    def __getitem__(self, key):
        return self.items_[key]

    def __iter__(self):
        return iter(self.items_)

    def __len__(self) -> int:
        return len(self.items_)


def containers(x: torch.Tensor, y: torch.Tensor) -> dict:
    """The same samples in every container kind; a 0-d tensor and a string ride along in some (kept whole)."""
    scale = torch.tensor(2.0, dtype=torch.float64)
    return {
        "dict": {"inputs": x, "labels": y, "scale": scale},
        "OrderedDict": collections.OrderedDict(inputs=x, labels=y),
        "UserDict": Encoding({"inputs": x, "labels": y, "scale": scale}, encodings="kept"),
        "namedtuple": Pair(x, y),
        "dataclass": Record(x, y),
        "frozen dataclass": Frozen(x, scale),
        "tuple": (x, y, "kept"),
        "list": [x, y],
        "nested": {"pair": Pair(inputs=[x, (x, scale)], labels=Record(y, y, note="inner")),
                   "encoded": Encoding({"ids": y}, encodings="inner"), "name": "kept"},
    }


def check_same_kind(out, batch, where="the batch") -> None:
    """``out`` has ``batch``'s containers, types and non-tensor leaves at every level."""
    assert type(out) is type(batch), f"{where}: {type(out).__name__}, not {type(batch).__name__}"
    if isinstance(batch, Mapping):
        assert list(out) == list(batch), where
        for k in batch:
            check_same_kind(out[k], batch[k], f"{where}[{k!r}]")
    elif isinstance(batch, (tuple, list)):
        for i, (a, b) in enumerate(zip(out, batch, strict=True)):
            check_same_kind(a, b, f"{where}[{i}]")
    elif dataclasses.is_dataclass(batch):
        for f in dataclasses.fields(batch):
            check_same_kind(getattr(out, f.name), getattr(batch, f.name), f"{where}.{f.name}")
    elif not isinstance(batch, torch.Tensor):
        assert out == batch, where
    if isinstance(batch, Encoding):
        assert out.encodings == batch.encodings, f"{where}: the UserDict's own attribute"


@pytest.fixture
def samples():
    torch.manual_seed(0)
    return torch.randn(5, 3, dtype=torch.float64), torch.arange(5)


@pytest.mark.parametrize("kind", list(containers(torch.zeros(1), torch.zeros(1))))
def test_every_container_keeps_its_type_through_slices_counts_and_moves(kind, samples):
    x, y = samples
    batch = containers(x, y)[kind]
    assert count_samples(batch) == 5
    parts = [slice_samples(batch, a, b) for a, b in ((0, 2), (2, 5))]
    for part, n in zip(parts, (2, 3)):
        check_same_kind(part, batch)
        assert count_samples(part) == n
        assert all(t.dim() == 0 or t.shape[0] == n for t in tensors(part))  # 0-d tensors kept whole
    whole = [t for t in tensors(batch) if t.dim() >= 1]
    cut = [[t for t in tensors(part) if t.dim() >= 1] for part in parts]
    for i, t in enumerate(whole):  # the two slices hold every sample once, in order
        assert torch.equal(torch.cat([cut[0][i], cut[1][i]]), t)
    moved = to_device(batch, "cpu")
    check_same_kind(moved, batch)
    as_float32 = map_tensors(batch, lambda t: t.float())
    check_same_kind(as_float32, batch)
    assert {t.dtype for t in tensors(as_float32)} == {torch.float32}
    assert [t.dtype for t in tensors(batch)] == [t.dtype for t in tensors(moved)]  # the batch itself unchanged


def test_leaves_come_depth_first_in_order_and_a_batch_without_tensors_has_no_count(samples):
    x, y = samples
    batch = {"a": Pair(y, [x, "s"]), "b": Record(x, y, note="n"), "c": 3}
    assert [type(v).__name__ if not isinstance(v, torch.Tensor) else tuple(v.shape) for v in leaves(batch)] == \
        [(5,), (5, 3), "str", (5, 3), (5,), "str", "int"]
    assert count_samples({"scale": torch.tensor(1.0), "name": "x"}) is None
    assert count_samples(((torch.tensor(1.0),), torch.zeros(4, 2))) == 4  # the first tensor with a dimension
    assert slice_samples({"rows": torch.zeros(3), "table": torch.zeros(4)}, 0, 1)["table"].shape == (4,)


def test_a_mapping_its_type_cannot_rebuild_becomes_a_plain_dict(samples):
    x, y = samples
    out = slice_samples(Strict(items={"inputs": x, "labels": y}), 1, 3)
    assert type(out) is dict and out["inputs"].shape == (2, 3)


def test_the_callers_keep_their_messages_and_now_walk_every_container(samples):
    """The objective's count (its two error lines), the criterion batches' move (namedtuple inputs), the shards of
    namedtuple and UserDict batches (each rank its share: once a crash and a UserDict kept whole) and the empirical
    Fisher's batches of one over a dataclass batch."""
    from flatfl.analysis import HessianOperator
    from flatfl.analysis.operators.batches import as_batches
    from flatfl.analysis.operators.curvatures import curvature_operator
    from flatfl.analysis.operators.distributed import shard_batches
    from flatfl.analysis.operators.objective import batch_samples
    from flatfl.train.algorithms.algorithm import ClientResult

    x, y = samples
    with pytest.raises(ConfigError, match=r"^batch 2 holds no tensor with a batch dimension \(a Encoding"):
        batch_samples(Encoding({"scale": torch.tensor(1.0)}), 2)
    with pytest.raises(ConfigError, match="^batch 0 is empty"):
        batch_samples(Pair(x[:0], y[:0]))
    (inputs, targets), = as_batches([(Pair(x, x), y)], device="cpu")
    assert type(inputs) is Pair and torch.equal(targets, y)
    for batch in (Pair(x, y), Encoding({"inputs": x, "labels": y}, encodings="kept")):
        shards = [shard_batches([batch], rank, 2, objective=True) for rank in range(2)]
        assert [count_samples(s[0]) for s in shards] == [3, 2]
        check_same_kind(shards[0][0], batch)

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    labels = y % 2

    def record_loss(model, batch):
        return F.cross_entropy(model(batch.inputs), batch.labels)

    def dict_loss(model, batch):
        return F.cross_entropy(model(batch["inputs"]), batch["labels"])

    V = torch.randn(sum(p.numel() for p in model.parameters()), 2, dtype=torch.float64)
    of_records = curvature_operator("empirical-fisher", model, [Record(x, labels)], loss=record_loss).matmat(V)
    of_dicts = curvature_operator("empirical-fisher", model, [{"inputs": x, "labels": labels}],
                                  loss=dict_loss).matmat(V)
    assert torch.allclose(of_records, of_dicts, rtol=1e-12, atol=0)
    assert HessianOperator(model, [Record(x, labels)], loss=record_loss).num_samples == 5

    result = ClientResult(3, 5, x.clone().requires_grad_(), 0.5, extras={"control": [y, Pair(x, y)]})
    moved = map_tensors(result, lambda t: t.detach().to("cpu"))  # how training hands results between ranks
    check_same_kind(moved, result)
    assert not moved.params.requires_grad and moved.client_id == 3


# the ranks' job: a Hessian with a user's loss over namedtuple and over UserDict batches

def problem():
    """The distributed tests' small float64 network and its evaluation batches (tests/rank_jobs.py), the batches as
    namedtuples and as UserDicts with their losses, and a block of vectors."""
    model, batches = rank_jobs.problem()
    scale = torch.tensor(0.5, dtype=torch.float64)
    pairs = [Pair(x, y) for x, y in batches]
    encoded = [Encoding({"input_ids": x, "labels": y, "scale": scale}, encodings="kept") for x, y in batches]
    dim = sum(p.numel() for p in model.parameters())
    V = torch.randn(dim, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return model, {"namedtuple": (pairs, pair_loss), "UserDict": (encoded, encoded_loss)}, V


def pair_loss(model, batch):
    return F.cross_entropy(model(batch.inputs), batch.labels)


def encoded_loss(model, batch):
    if not isinstance(batch, Encoding) or batch.encodings != "kept":
        raise TypeError(f"the loss was given a {type(batch).__name__}, not the Encoding with its attributes")
    return batch.scale * F.cross_entropy(model(batch.input_ids), batch.labels)


def hessian_numbers() -> dict:
    """For each batch kind: a block of Hessian products, a Hutchinson trace and this rank's number of samples (all
    of them in one process)."""
    from flatfl.analysis import HessianOperator
    from flatfl.analysis.estimators.by_name import estimate_trace
    from flatfl.analysis.operators.distributed import over_ranks
    from flatfl.utils import ranks

    ranks.join(torch.device("cpu"))
    model, kinds, V = problem()
    out = {}
    for kind, (batches, loss) in kinds.items():
        op = over_ranks(lambda shard, loss=loss: HessianOperator(model, shard, loss=loss), batches, objective=True)
        out[f"{kind} products"] = op.matmat(V)
        out[f"{kind} trace"] = torch.tensor(float(estimate_trace(op, "hutchinson", max_hvps=8, rtol=None,
                                                                 seed=0).estimate))
        out[f"{kind} samples"] = getattr(op, "op", op).num_samples
    return out


def test_a_hessian_over_namedtuple_and_userdict_batches_on_two_ranks_equals_one_process(tmp_path):
    reference = hessian_numbers()
    assert reference["namedtuple samples"] == reference["UserDict samples"] == rank_jobs.SAMPLES == sum(SHARES)
    results = run_ranks([str(Path(__file__)), str(tmp_path / "walk")], 2, timeout=120)
    bad = [(rank, code, err[-2000:]) for rank, (code, _, err) in enumerate(results) if code != 0]
    assert not bad, bad
    for rank, share in enumerate(SHARES):
        got = torch.load(tmp_path / f"walk.rank{rank}.pt", weights_only=True)
        for kind in ("namedtuple", "UserDict"):
            assert got[f"{kind} samples"] == share, f"rank {rank} holds {got[f'{kind} samples']} {kind} samples"
            for name in ("products", "trace"):
                a, b = got[f"{kind} {name}"], reference[f"{kind} {name}"]
                assert torch.allclose(a, b, rtol=1e-12, atol=0), f"rank {rank}, {kind} {name}: {(a - b).abs().max()}"


if __name__ == "__main__":
    from flatfl.utils import ranks as flatfl_ranks

    numbers = hessian_numbers()
    torch.save(numbers, f"{sys.argv[1]}.rank{flatfl_ranks.world().rank}.pt")
