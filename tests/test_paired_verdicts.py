"""Verdicts paired by seed (flatfl.report.paired, direction_checks): the statistics against a hand computation on a
small table of per-seed values, and the premise of pairing, that X and X+MAN of one seed share the partition and
the initial weights."""
from __future__ import annotations

import math

import pytest
import torch

from flatfl.paper_tables import TABLES
from flatfl.report.paired import paired_differences, paired_stats, seeds_needed
from flatfl.report.tables import build_table
from flatfl.report.verdicts import direction_checks

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
    assert c["verdict"] == c["unpaired_verdict"] == "no paper value"  # no paper value given
    # the means 11 (sd 1.414, se 1) -> 5.5 (sd 0.707, se 0.5): |-5.5| > 2 sqrt(1 + 0.25) = 2.236: resolved lower
    assert c["ours_uncertainty"] == pytest.approx(math.sqrt(1.25)) and c["effect"] == "lower"


def _checks(ref: dict, cmp_: dict, paper: list[dict]) -> dict:
    """The FedAvg vs FedAvg+MAN checks of man-table2 (dirichlet-0.3) on per-seed top eigenvalues."""
    spec = TABLES["man-table2"]
    runs = [FakeRun("FedAvg", s, {"top_eigenvalue": v}) for s, v in ref.items()] + \
        [FakeRun("FedAvg+MAN", s, {"top_eigenvalue": v}) for s, v in cmp_.items()]
    return next(c for c in direction_checks(spec, build_table(spec, runs, paper))
                if c["compared"] == "FedAvg+MAN" and c["partition"] == "dirichlet-0.3")


def _paper(ref: float, cmp_: float) -> list[dict]:
    return [{"source": "MAN", "table": "Table 2", "method": m, "partition": "dirichlet-0.3",
             "metric": "top_eigenvalue", "value": v} for m, v in (("FedAvg", ref), ("FedAvg+MAN", cmp_))]


def test_a_resolved_change_without_a_paper_value_is_said_and_never_inconclusive():
    # diffs -1.0, -1.2, -0.8: interval -1 +- 4.3027 * 0.2 / sqrt(3) = [-1.497, -0.503], excludes 0
    c = _checks({0: 10.0, 1: 14.0, 2: 12.0}, {0: 9.0, 1: 12.8, 2: 11.2}, [])
    assert c["paired_ci_high"] == pytest.approx(-1.0 + T975[2] * 0.2 / math.sqrt(3), abs=1e-6)
    assert c["effect"] == "lower" and c["verdict"] == "no paper value" and c["paper_direction"] is None
    # diffs +1.0, +1.2, +0.8: the mirror image, higher
    up = _checks({0: 10.0, 1: 14.0, 2: 12.0}, {0: 11.0, 1: 15.2, 2: 12.8}, [])
    assert up["paired_ci_low"] == pytest.approx(1.0 - T975[2] * 0.2 / math.sqrt(3), abs=1e-6)
    assert up["effect"] == "higher" and up["verdict"] == "no paper value"
    # diffs -1, -1, -3: interval [-4.54, 1.20] holds 0: unresolved, and still no paper value to agree with
    flat = _checks({0: 10.0, 1: 14.0, 2: 12.0}, {0: 9.0, 1: 13.0, 2: 9.0}, [])
    assert flat["paired_ci_low"] < 0 < flat["paired_ci_high"]
    assert flat["effect"] == "unresolved" and flat["verdict"] == "no paper value"
    # with the paper's direction: the same resolved fall agrees with a paper fall, disagrees with a paper rise
    assert _checks({0: 10.0, 1: 14.0, 2: 12.0}, {0: 9.0, 1: 12.8, 2: 11.2}, _paper(20.0, 10.0))["verdict"] == "agree"
    against = _checks({0: 10.0, 1: 14.0, 2: 12.0}, {0: 9.0, 1: 12.8, 2: 11.2}, _paper(10.0, 20.0))
    assert against["verdict"] == "disagree" and against["effect"] == "lower"
    # the paper's direction with an interval holding 0: inconclusive, unresolved
    held = _checks({0: 10.0, 1: 14.0, 2: 12.0}, {0: 9.0, 1: 13.0, 2: 9.0}, _paper(20.0, 10.0))
    assert held["verdict"] == "inconclusive" and held["effect"] == "unresolved"


def test_without_an_interval_between_seeds_the_effect_is_unresolved():
    # one seed a side: a change of -5 with no spread between seeds known: no effect claimed, with or without a paper
    one = _checks({0: 10.0}, {0: 5.0}, [])
    assert one["effect"] == "unresolved" and one["verdict"] == "no paper value"
    assert _checks({0: 10.0}, {0: 5.0}, _paper(20.0, 10.0))["verdict"] == "too few seeds"


def test_effect_is_consistent_with_its_interval_on_many_made_up_tables():
    """Random per-seed values (2-4 seeds a side, partly shared), with and without a paper value: the effect is what
    the interval the verdict is judged from says, recomputed here from the check's own numbers, and no check
    whose interval excludes 0 is 'inconclusive'."""
    import random

    rng = random.Random(5)
    seen = set()
    for _ in range(300):
        seeds_a = rng.sample(range(5), rng.randint(2, 4))
        seeds_b = rng.sample(range(5), rng.randint(2, 4))
        shift = rng.choice([-3.0, 0.0, 3.0])
        ref = {s: 10.0 + rng.gauss(0, 1) for s in seeds_a}
        cmp_ = {s: 10.0 + shift + rng.gauss(0, 1) for s in seeds_b}
        c = _checks(ref, cmp_, rng.choice([[], _paper(20.0, 10.0), _paper(10.0, 20.0)]))
        if c["verdict_from"].startswith("paired"):
            low, high = c["paired_ci_low"], c["paired_ci_high"]
        else:  # unpaired: the change of the means +- twice its standard error
            low = c["ours_change"] - 2 * c["ours_uncertainty"]
            high = c["ours_change"] + 2 * c["ours_uncertainty"]
        want = "lower" if high < 0 else "higher" if low > 0 else "unresolved"
        assert c["effect"] == want, c
        if want != "unresolved":
            assert c["verdict"] in ("agree", "disagree", "no paper value"), c
        else:
            assert c["verdict"] in ("inconclusive", "no paper value"), c
        seen.add((c["verdict_from"][:6], want, c["verdict"]))
    # every kind of interval, effect and verdict occurred
    assert {k[0] for k in seen} == {"paired", "unpair"}
    assert {k[1] for k in seen} == {"lower", "higher", "unresolved"}
    assert {k[2] for k in seen} == {"agree", "disagree", "inconclusive", "no paper value"}


def test_summary_counts_both_effects_and_verdicts():
    from flatfl.report.verdicts import summary_counts

    checks = [_checks({0: 10.0, 1: 14.0, 2: 12.0}, {0: 9.0, 1: 12.8, 2: 11.2}, []),
              _checks({0: 10.0, 1: 14.0, 2: 12.0}, {0: 11.0, 1: 15.2, 2: 12.8}, _paper(10.0, 20.0)),
              _checks({0: 10.0, 1: 14.0, 2: 12.0}, {0: 9.0, 1: 13.0, 2: 9.0}, _paper(20.0, 10.0))]
    c = summary_counts(checks)["top_eigenvalue"]
    assert c["effects"] == {"lower": 1, "higher": 1, "unresolved": 1}
    assert (c["agree"], c["disagree"], c["inconclusive"], c["no paper value"]) == (1, 0, 1, 1)
    from flatfl.report.text import counts_line

    line = counts_line("top_eigenvalue", c)
    assert "our change 1 lower, 1 higher, 1 unresolved" in line and "1 without a paper value" in line


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
