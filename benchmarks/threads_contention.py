"""Wall time of ``flatfl train`` and ``flatfl hessian --method power`` beside a competing CPU-bound process, with
torch's own default thread count against flatfl's default (``flatfl/utils/threads.py``), in one run.

Steps:

1. a small checkpoint: ``flatfl train --rounds 2 --clients 4`` (digits), on one thread, before anything is timed;
2. a competitor: one Python busy loop (one core kept busy for the whole benchmark), started first; the script waits
   ``--settle`` seconds so that it shows in the load average too;
3. for each command, alternating the two settings: ``--threads T`` where T is what torch picks by itself in a fresh
   process (its old default: one thread per core) against no flag at all (flatfl's default); each command is a
   fresh ``python -m flatfl`` process, timed from start to exit.

Printed: each wall time, and for each command the ratio old / new. The machine, its cores, the load average and the
threads each setting used are printed first.

    python benchmarks/threads_contention.py [--train-rounds 50] [--repeats 1] [--settle 5]

``--train-rounds`` defaults to 50 (``flatfl train`` with no flags); the other train settings are the defaults.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUSY_LOOP = "import time\nwhile True:\n    pass\n"


def flatfl(*args: str, env: dict) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "flatfl", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"flatfl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return seconds


def torch_default_threads(env: dict) -> int:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def flatfl_default_threads(env: dict) -> int:
    code = "from flatfl.utils.threads import default_threads; print(default_threads())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-rounds", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds between starting the competitor and timing")
    ap.add_argument("--extra-threads", type=int, nargs="*", default=[],
                    help="also time these explicit --threads values (e.g. 1 on a many-core machine)")
    args = ap.parse_args()

    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # let torch pick its own default
        env.pop(var, None)
    old = torch_default_threads(env)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        flatfl("train", "--rounds", "2", "--clients", "4", "--threads", "1", "--quiet", "--out", str(tmp / "ckpt"),
               env=env)
        ckpt = str(tmp / "ckpt" / "final.pt")
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average before the competitor "
              f"{os.getloadavg()[0]:.2f}; python {platform.python_version()}")
        competitor = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
        try:
            time.sleep(args.settle)
            new = flatfl_default_threads(env)
            print(f"competitor: one Python busy loop (pid {competitor.pid}); load average now {os.getloadavg()[0]:.2f}")
            print(f"threads: torch's default {old}, flatfl's default {new}")
            commands = {
                f"flatfl train (defaults, {args.train_rounds} rounds)":
                    lambda out: ["train", "--rounds", str(args.train_rounds), "--quiet", "--out", out],
                "flatfl hessian --method power (top 1 + PyHessian trace, whole train split)":
                    lambda out: ["hessian", ckpt, "--method", "power", "--quiet", "--out", out],
            }
            times: dict[str, dict[str, list[float]]] = {}
            labels = ["old", "new"] + [f"{n} threads" for n in args.extra_threads]
            for name, make in commands.items():
                times[name] = {label: [] for label in labels}
                for r in range(args.repeats):
                    for label in labels:
                        out = str(tmp / f"{len(times)}-{label.replace(' ', '')}-{r}")
                        n = old if label == "old" else new if label == "new" else int(label.split()[0])
                        extra = [] if label == "new" else ["--threads", str(n)]
                        t = flatfl(*make(out), *extra, env=env)
                        times[name][label].append(t)
                        shown = f"{label} default ({n} threads)" if label in ("old", "new") else f"explicit {label}"
                        print(f"  {name}: {shown}: {t:.1f} s", flush=True)
        finally:
            competitor.kill()
            competitor.wait()
    print("\nsummary (median wall time beside one busy core; ratio = torch default / flatfl default):")
    for name, t in times.items():
        med = {k: sorted(v)[len(v) // 2] for k, v in t.items()}
        o, n = med["old"], med["new"]
        extra = "".join(f"; {k}: {v:.1f} s" for k, v in med.items() if k not in ("old", "new"))
        print(f"  {name}: {o:.1f} s with {old} threads vs {n:.1f} s with {new}: ratio {o / n:.1f}x{extra}")


if __name__ == "__main__":
    main()
