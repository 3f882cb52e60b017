"""A reproduction's progress: the order its runs start in, the time left weighted by each run's work, and the lines
that say, between run lines, which runs are under way and how far each is."""
from __future__ import annotations

import json
import time
from pathlib import Path

from flatfl import reproduce as rep
from flatfl.sweep import RunTask


def task(tmp_path, name: str, spectrum: bool = False) -> RunTask:
    return RunTask(name, str(tmp_path / name), {"rounds": 30}, hessian={"top": 1},
                   spectrum={"top": 50} if spectrum else None, model="clients-average")


def test_one_light_run_per_worker_starts_first_then_the_heaviest():
    tasks = [task(Path("/x"), n, spectrum=n.startswith("s")) for n in ("s1", "a", "s2", "b", "c")]
    assert rep.execution_order(tasks, 2) == [1, 3, 0, 2, 4]  # a, b; then s1, s2 (heavy); then c
    assert rep.execution_order(tasks, 1) == [1, 0, 2, 3, 4]
    assert sorted(rep.execution_order(tasks, 8)) == list(range(5))


def test_the_time_left_counts_a_spectrum_run_as_more_work(tmp_path):
    """Two light runs and one with the spectrum (1 + SPECTRUM_WEIGHT units): after a light run took 10 s, the
    estimate is 10 s a unit times the units left."""
    tasks = [task(tmp_path, "a"), task(tmp_path, "b"), task(tmp_path, "s", spectrum=True)]
    clock = iter([0.0, 10.0, 20.0])
    lines = []
    progress = rep.Progress(tasks, lines.append, clock=lambda: next(clock))
    progress.done(tasks[0], {}, "a: done")
    progress.done(tasks[1], {}, "b: done")
    heavy = 1 + rep.SPECTRUM_WEIGHT
    assert lines[0] == f"a: done | 10 s elapsed, about {round(10 * (1 + heavy))} s left"
    assert lines[1] == f"b: done | 20 s elapsed, about {round(10 * heavy)} s left"


def test_a_run_under_way_says_how_far_it_is(tmp_path):
    t = task(tmp_path, "r", spectrum=True)
    since = time.time() - 1
    assert rep.run_stage(t, since) is None  # not started
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "metrics.csv").write_text("round,lr\n5,0.1\n10,0.1\n")
    assert rep.run_stage(t, since) == "training, round 10 of 30"
    assert rep.run_stage(t, time.time() + 60) is None  # nothing changed since: not this reproduction's
    (folder / "final.pt").write_bytes(b"")
    assert rep.run_stage(t, since) == "hessian"
    (folder / "hessian-clients-average").mkdir()
    (folder / "hessian-clients-average" / "hessian.json").write_text(json.dumps({}))
    assert rep.run_stage(t, since) == "spectrum"


def test_a_heartbeat_line_names_the_runs_under_way_when_no_run_ends(tmp_path):
    """With no run line for the heartbeat's interval, one line names each run under way and its stage, with the
    time elapsed; it stops when the progress is closed."""
    tasks = [task(tmp_path, "a"), task(tmp_path, "b")]
    lines = []
    progress = rep.Progress(tasks, lines.append, heartbeat=0.2)
    try:
        (tmp_path / "a").mkdir()
        (tmp_path / "a" / "metrics.csv").write_text("round\n5\n")
        deadline = time.monotonic() + 10
        while not lines and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        progress.close()
    assert lines and lines[0].startswith("... 0 of 2 runs trained; under way: a (training, round 5 of 30) | ")
    assert "elapsed, time left known after the first run trained" in lines[0]
    count = len(lines)
    time.sleep(0.5)
    assert len(lines) == count  # closed: no more lines


def test_a_heartbeat_counts_down_the_last_estimate(tmp_path):
    """Between run lines the time left is the last run line's estimate less the time since, not a new rate that
    would count the runs under way as no work done."""
    tasks = [task(tmp_path, "a"), task(tmp_path, "b"), task(tmp_path, "c")]
    clock = iter([0.0, 10.0, 40.0])
    lines = []
    progress = rep.Progress(tasks, lines.append, clock=lambda: next(clock))
    progress.done(tasks[0], {}, "a: done")  # 10 s a run, 2 left: about 20 s
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.csv").write_text("round\n25\n")
    assert lines == ["a: done | 10 s elapsed, about 20 s left"]
    assert progress.heartbeat() == ("... 1 of 3 runs trained; under way: b (training, round 25 of 30) | 40 s elapsed, "
                                    "about 0 s left")
