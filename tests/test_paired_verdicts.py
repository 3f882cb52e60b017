"""Verdicts paired by seed (flatfl.report.paired, direction_checks): the statistics against a hand computation on a
small table of per-seed values, and the premise of pairing, that X and X+MAN of one seed share the partition and
the initial weights."""
from __future__ import annotations

import math

import pytest
import torch

from flatfl.paper_tables import TABLES
from flatfl.report.paired import paired_differences, paired_stats, seeds_needed
from flatfl.report.tables import build_table, direction_checks

# Student's t quantiles t(0.975, dof) from printed tables (e.g. Abramowitz & Stegun 26.10)
T975 = {1: 12.706205, 2: 4.302653, 5: 2.570582, 6: 2.446912}


def test_paired_stats_by_hand():
    ref = {0: 10.0, 1: 14.0, 2: 12.0}
    cmp_ = {0: 9.0, 1: 12.8, 2: 11.2, 7: 3.0}  # seed 7 has no partner: left out
    d = paired_differences(ref, cmp_)
    assert list(d) == [0, 1, 2] and [round(v, 12) for v in d.values()] == [-1.0, -1.2, -0.8]
    s = paired_stats(d.values())
    # mean -1.0; deviations 0, -0.2, 0.2 -> sd sqrt(0.08 / 2) = 0.2; se 0.2 / sqrt(3)
    assert s["k"] == 3 and s["mean"] == pytest.approx(-1.0, abs=1e-12)
    assert s["sd"] == pytest.approx(0.2, abs=1e-12) and s["se"] == pytest.approx(0.2 / math.sqrt(3), abs=1e-12)
    assert s["t"] == pytest.approx(T975[2], abs=1e-6)
    half = T975[2] * 0.2 / math.sqrt(3)  # 0.49683
    assert s["low"] == pytest.approx(-1.0 - half, abs=1e-6) and s["high"] == pytest.approx(-1.0 + half, abs=1e-6)
    assert s["resolved"] is True
    one = paired_stats([2.5])
    assert one["k"] == 1 and one["mean"] == 2.5 and one["sd"] is None and one["resolved"] is None


def test_seeds_needed_by_hand():
    # sd 1, change 1: t(0.975, 5) / sqrt(6) = 1.0494 >= 1, t(0.975, 6) / sqrt(7) = 0.9248 < 1 -> 7 seeds
    assert T975[5] / math.sqrt(6) > 1 > T975[6] / math.sqrt(7)
    assert seeds_needed(1.0, 1.0) == 7 and seeds_needed(1.0, -1.0) == 7
    assert seeds_needed(0.0, 0.3) == 2  # no spread: the smallest sample with a spread resolves it
    assert seeds_needed(1.0, 0.0) is None and seeds_needed(None, 1.0) is None
    assert seeds_needed(1.0, 1e-4) is None  # beyond MAX_SEEDS


class FakeRun:
    """What build_table reads of a run: its method, partition, seed and one value per metric."""

    def __init__(self, method, seed, values, partition="dirichlet-0.3"):
        self.method, self.seed, self.partition, self.values = method, seed, partition, values
        self.name, self.model, self.dataset = f"{method}-s{seed}", "clients-average", "digits"

    def value(self, metric):
        return self.values.get(metric)

    def stderr(self, metric):
        return None

    def setting(self, metric):
        return "same"


def test_direction_checks_pair_by_seed_and_keep_unpaired():
    spec = TABLES["man-table2"]
    ref = {0: 10.0, 1: 14.0, 2: 12.0}
    eig = {0: 9.0, 1: 12.8, 2: 11.2}  # diffs -1.0, -1.2, -0.8: resolved by pairing, not by the means' spread
    tr = {0: 9.0, 1: 13.0, 2: 9.0}  # diffs -1, -1, -3: mean -5/3, sd 1.1547, CI holds 0
    runs = [FakeRun("FedAvg", s, {"top_eigenvalue": ref[s], "trace": ref[s]}) for s in ref] + \
        [FakeRun("FedAvg+MAN", s, {"top_eigenvalue": eig[s], "trace": tr[s]}) for s in ref]
    paper = [{"source": "MAN", "table": "Table 2", "method": m, "partition": "dirichlet-0.3", "metric": k, "value": v}
             for m, v in (("FedAvg", 20.0), ("FedAvg+MAN", 10.0)) for k in ("top_eigenvalue", "trace")]
    rows = build_table(spec, runs, paper)
    checks = {c["metric"]: c for c in direction_checks(spec, rows) if c["compared"] == "FedAvg+MAN"
              and c["partition"] == "dirichlet-0.3"}
    e, t = checks["top_eigenvalue"], checks["trace"]
    # top eigenvalue: paired agrees (CI [-1.497, -0.503]); unpaired: change -1 within 2 * sqrt(se_a^2 + se_b^2)
    se_a, se_b = 2.0 / math.sqrt(3), math.sqrt(7.28 / 2) / math.sqrt(3)  # deviations (-2, 1.8, 0.2): sd 1.908
    assert e["ours_change"] == pytest.approx(-1.0) and e["ours_uncertainty"] == pytest.approx(math.hypot(se_a, se_b))
    assert e["unpaired_verdict"] == "inconclusive" and e["verdict"] == "agree" and e["verdict_from"] == "paired, k=3"
    assert e["paired_ci_high"] == pytest.approx(-1.0 + T975[2] * 0.2 / math.sqrt(3), abs=1e-6)
    assert e["seeds_needed"] is None  # resolved: nothing to ask
    # trace: mean -5/3, deviations 2/3, 2/3, -4/3: sd sqrt((4/9 + 4/9 + 16/9) / 2) = 1.1547
    sd = math.sqrt(((2 / 3) ** 2 * 2 + (4 / 3) ** 2) / 2)
    assert t["paired_change"] == pytest.approx(-5 / 3) and t["paired_sd"] == pytest.approx(sd)
    assert t["paired_ci_low"] < 0 < t["paired_ci_high"] and t["verdict"] == "inconclusive"
    # the paper halves the value (-50%); at our reference 12 that is a change of 6; sd 1.1547:
    # n=2: 12.706 * 1.1547 / 1.414 = 10.4 >= 6; n=3: 4.3027 * 1.1547 / 1.732 = 2.87 < 6 -> 3 seeds
    assert t["paper_size_change"] == pytest.approx(-6.0)
    assert t["seeds_needed"] == 3
    assert T975[1] * sd / math.sqrt(2) > 6 > T975[2] * sd / math.sqrt(3)


def test_one_shared_seed_falls_back_to_unpaired():
    spec = TABLES["man-table2"]
    runs = [FakeRun("FedAvg", 0, {"top_eigenvalue": 10.0}), FakeRun("FedAvg", 1, {"top_eigenvalue": 12.0}),
            FakeRun("FedAvg+MAN", 1, {"top_eigenvalue": 5.0}), FakeRun("FedAvg+MAN", 2, {"top_eigenvalue": 6.0})]
    rows = build_table(spec, runs, [])
    c = next(c for c in direction_checks(spec, rows) if c["compared"] == "FedAvg+MAN" and c["metric"] ==
             "top_eigenvalue" and c["partition"] == "dirichlet-0.3")
    assert c["paired_seeds"] == 1 and c["verdict_from"].startswith("unpaired")
    assert c["verdict"] == c["unpaired_verdict"] == "inconclusive"  # no paper value given


def test_same_seed_same_partition_and_initial_weights(tmp_path):
    """The premise of pairing: the seed alone fixes the partition and the initial weights, whatever the method."""
    from flatfl.train.config import build_config
    from flatfl.train.engine import Trainer

    def trainer(seed, **extra):
        cfg = build_config({}, dict(dataset="digits", model="digits-cnn", clients=5, rounds=1, seed=seed,
                                    threads=1, **extra))
        return Trainer(cfg, tmp_path / f"r{seed}-{len(extra)}-{extra.get('algo', '')}", quiet=True)

    a = trainer(3)
    b = trainer(3, reg="man", params={"zeta": 0.6})
    c = trainer(3, algo="feddyn")
    other = trainer(4)
    for t in (b, c):
        assert all((x == y).all() for x, y in zip(a.partition.client_indices, t.partition.client_indices))
        assert torch.equal(a.theta, t.theta)
    assert not torch.equal(a.theta, other.theta)
    assert any(len(x) != len(y) or (x != y).any()
               for x, y in zip(a.partition.client_indices, other.partition.client_indices))
