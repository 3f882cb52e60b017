"""Every GPU check in one command: one markdown table of figures against their goals, ready for the next GPU.

    python3 benchmarks/gpu_check.py --out DIR             # on a GPU: at most 8 minutes, every part under a timeout
    python3 benchmarks/gpu_check.py --smoke --out DIR     # the same code paths on the CPU at toy sizes (CI)
    python3 benchmarks/gpu_check.py --smoke --minimal --out DIR   # fewer cases still (the test suite's run)

The parts, each run as a child process of this script (``--part NAME``) with its own timeout, so that a part that
hangs or runs slow is reported as "timed out" and the others still run:

* ``equivalence`` (benchmarks/cuda_equivalence.py part 1): the covering set of model x regularizer x algorithm x
  optimizer cases (``pairwise_combinations`` of tests/combinations.py), trained in float64 one client at a time on
  the CPU (the reference), and on the device one client at a time and all clients together. Goal: every quantity
  within 1e-9 relative of the CPU's.
* ``graphs`` (cuda_equivalence.py ``--cuda-graphs``): every registered piece (``step_graph_combinations``) trained
  on the device in float64 with its full steps replayed as CUDA graphs against the same run stepped eagerly. Goal:
  within 1e-9 relative.
* ``round-time`` (benchmarks/gpu_round_time.py): seconds a round at the MAN paper's shape for FedAvg, FedAvg + MAN,
  FedDyn + MAN, FedSAM, FedSpeed + MAN, FedAvg + ASD, clients one at a time, together, and together with CUDA
  graphs (median of 3 rounds after a warm-up). Goals: every method <= 0.12 s a round, FedAvg + MAN <= 1.10x
  FedAvg (on the graphed rounds).
* ``flsam-cost`` (benchmarks/flsam_cost.py ``--size full``): seconds a round of FedAvg, FedDyn, FedSAM, FedSpeed,
  FedSMOO, FedLESAM-D and FedGMT (when registered), each without and with MAN, in FL-SAM's configuration (CIFAR-10
  shape, 100 clients, 10 a round, 5 epochs of batch 50) on its CNN and its ResNet-18, one timed round after a warm-up
  each. Goals: each method's ratio to FedAvg at most 1.05 x the ratio FL-SAM publishes (RTX 4090), and MAN at most
  1.10x the method without it. A part stopped by its timeout reports the methods it had measured.
* ``hessian`` (benchmarks/hessian_gpu.py): the Hessian engine against PyHessian on the MAN CIFAR-100 CNN at 512
  inputs: top-1, top-20, the trace, and each trace estimator's share of its time spent outside the products.
  Goals: top-1 no slower than PyHessian, top-20 >= 25x faster than PyHessian, Hutchinson no slower than PyHessian
  at equal products, own work <= 10%. Without PyHessian (``import pyhessian`` fails) its rows say so and are "not
  measured".
* ``distributed`` (benchmarks/distributed_scaling.py): with several GPUs visible, the Hessian (top-20 and a trace)
  and fmnist-cnn training rounds under torchrun over every GPU (nccl) against one GPU. Goal: at least 0.8 x the GPU
  count faster, the numbers within 1e-4. With one GPU (and in ``--smoke``) its rows are "not measured".
* ``table`` (cuda_equivalence.py part 2): ``flatfl reproduce man-tables --preset fmnist`` trained and analysed on
  the device, against the committed CPU tables (reports/man-tables-fmnist), row by row. Goal: every row's mean
  within its seeds' spread. Needs Fashion-MNIST's four files (``--data-dir``, or Debian's
  /usr/share/datasets/fashion-mnist).

The timing parts run first, alone; then the three others together (they compare numbers, not times). The
timeouts (round-time 130 s, hessian 110 s, distributed 150 s, flsam-cost 90 s, the three others 230 s each;
``--timeout PART=SECONDS`` changes one) are cut to what is left of ``--budget`` seconds (470 by default: 8 minutes
with the start); ``--parts`` runs some only. ``flsam-cost`` runs on a GPU only when named (``--parts flsam-cost``, a
second command of its own), so that the default run keeps its time for the checks of numbers. ``--out DIR`` receives ``gpu-check.md`` (a header line with
the device, torch, flatfl and the date, then the table: check, figure, goal, met: yes / no / not measured / timed
out / failed) and each part's raw log (``PART.log``, its figures in ``PART.json``); the table is printed. Exit 0
when every part ran to its end (a goal not met is reported, not an error); 1, with one line, when a part failed,
crashed or timed out; 2 when the command cannot start (no CUDA device without --smoke, an --out that is a non-empty
folder not made by gpu_check).

``--smoke`` runs the same code on the CPU at toy sizes in about a minute: 3 equivalence cases, 2 graph cases (steps
replayed by tests/graph_replay.py's CPU recorder in place of CUDA graphs), the gpu_round_time ``--small`` shape for
one round, flsam_cost.py's ``--size small`` for FedAvg and FedSAM (one timed round, one thread), a digits CNN's
Hessian at 32 inputs, and ``reproduce man-table2 --preset tiny`` for FedAvg on one seed, compared with itself (there
is no committed tiny table). Its timings mean nothing. ``--smoke --minimal`` (the test suite's) trains one
equivalence case and one graph case, both of the tiny network, taken from the step-graph list (without computing the
covering set, which takes seconds), times the flsam-cost methods on the CNN only, and reproduces Table 6's FedASAM
row (its runs have no spectrum analysis); the other parts as in ``--smoke``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MARKER = ".gpu-check"  # in every --out folder this script made
TABLE = "gpu-check.md"
RTOL = 1e-9

#: the parts, in the order they run: (name, seconds on a GPU, seconds in --smoke, runs alone); the table lists them
#: in DISPLAY order
PARTS = [("round-time", 130, 60, True), ("hessian", 110, 60, True), ("distributed", 150, 30, True),
         ("flsam-cost", 90, 60, True),
         ("equivalence", 230, 60, False), ("graphs", 230, 60, False), ("table", 230, 60, False)]
DEFAULT_BUDGET = 470
#: parts that run only when --parts names them on a GPU (every part runs in --smoke): the FL-SAM comparison is a
#: second command of its own, so that the default run keeps its 8 minutes for the checks of numbers
OPT_IN = ("flsam-cost",)
DISPLAY = ["equivalence", "graphs", "round-time", "flsam-cost", "hessian", "distributed", "table"]

ROUND_METHODS = ["FedAvg", "FedAvg + MAN", "FedDyn + MAN", "FedSAM", "FedSpeed + MAN", "FedAvg + ASD"]
ROUNDS = 3  # timed rounds a mode (median), after a warm-up round

#: the Hessian part's sizes: (inputs, top-k sizes, PyHessian's k, Hutch++ budget)
HESSIAN = dict(full=(512, [1, 20], [1, 20], 90), smoke=(32, [1, 5], [1, 5], 30))
#: --smoke's round shape: clients, per round, images a client, local epochs, batch, classes
SMOKE_ROUND_SHAPE = (10, 2, 20, 1, 10, 10)

#: the flsam-cost part's networks (flsam_cost.py's keys and labels), its timed rounds on a GPU, --smoke's methods
FLSAM_MODELS = [("cnn", "CNN"), ("resnet18", "ResNet-18")]
FLSAM_ROUNDS = 1
FLSAM_SMOKE_METHODS = ["FedAvg", "FedSAM"]


def checks(part: str, smoke: bool) -> list[tuple[str, str]]:
    """(check, goal) of every row a part gives, in order (a part that produced nothing still has its rows)."""
    if part == "equivalence":
        goal = f"within {RTOL:g} relative of the CPU (float64)"
        return [("CPU one at a time vs device one at a time", goal), ("CPU one at a time vs device together", goal)]
    if part == "graphs":
        return [("device together: graphed vs eager steps (--cuda-graphs)", f"within {RTOL:g} relative (float64)")]
    if part == "round-time":
        out = []
        for label in ROUND_METHODS:
            out.append((f"s/round {label}", "<= 0.12 s a round (graphed)"))
            if label == "FedAvg + MAN":
                out.append(("s/round FedAvg + MAN / FedAvg", "<= 1.10x (graphed)"))
        return out
    if part == "hessian":
        n, ks, _, _ = HESSIAN["smoke" if smoke else "full"]
        return [(f"Hessian top-1 ({n} inputs)", "no slower than PyHessian"),
                (f"Hessian top-{ks[-1]} ({n} inputs)", ">= 25x faster than PyHessian"),
                (f"Hessian trace ({n} inputs)", "Hutchinson no slower than PyHessian at equal products"),
                (f"Hutchinson: own work ({n} inputs)", "<= 10% of its time outside the products"),
                (f"Hutch++: own work ({n} inputs)", "<= 10% of its time outside the products")]
    if part == "flsam-cost":
        out = []
        for _, label in FLSAM_MODELS:
            out.append((f"FL-SAM's configuration, its {label}: s/round x FedAvg",
                        "<= 1.05 x FL-SAM's ratio (RTX 4090), every method"))
            out.append((f"FL-SAM's configuration, its {label}: + MAN / without", "<= 1.10x, every method"))
        return out
    if part == "distributed":
        goal = ">= 0.8 x the GPU count faster than one GPU; numbers within 1e-4"
        return [("Hessian top-20 + trace over every GPU (torchrun, nccl)", goal),
                ("fmnist-cnn training rounds over every GPU (torchrun, nccl)", goal)]
    if part == "table":
        name = "tiny preset (smoke)" if smoke else "Fashion-MNIST MAN tables"
        return [(f"{name} on the device vs the CPU table", "every row's mean within its seeds' spread")]
    raise ValueError(part)


# ----- the children: one part each ----------------------------------------------------------------------------------


class Result:
    """A part's rows, written to ``path`` (JSON) after every change, so that a part stopped by its timeout leaves
    what it had measured."""

    def __init__(self, path: Path, part: str, smoke: bool):
        self.path, self.rows, self.complete = path, {c: dict(check=c, goal=g, figure="", met="")
                                                     for c, g in checks(part, smoke)}, False
        self.env: dict = {}

    def set(self, check: str, figure: str, met: str) -> None:
        self.rows[check].update(figure=figure, met=met)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(rows=list(self.rows.values()), complete=self.complete, env=self.env)))
        os.replace(tmp, self.path)


def yes(ok: bool) -> str:
    return "yes" if ok else "no"


def _cases_figure(fig: dict, worst: float) -> str:
    checked = fig["done"] - fig["refused"]
    text = f"cases compared: {checked}" + (f" ({fig['done']} of {fig['cases']} done)" if fig["done"] < fig["cases"]
                                           else "") + f", largest relative difference {worst:.1e}"
    if fig["refused"]:
        text += f"; {fig['refused']} refused before training"
    if fig["failed"]:
        text += f"; off: {', '.join(fig['failed'][:3])}" + (" ..." if len(fig["failed"]) > 3 else "")
    return text + f"; {fig['seconds']:.0f} s"


def part_equivalence(args, result: Result, tmp: Path) -> None:
    import cuda_equivalence as ce
    from combinations import pairwise_combinations

    if args.smoke and args.minimal:  # one case of the tiny network, without building the covering set
        from combinations import step_graph_combinations

        cases = [c for c in step_graph_combinations() if c.model == "tiny"][:1]
    else:
        cases = pairwise_combinations()
        cases = cases[:3] if args.smoke else cases
    (one, one_goal), (together, together_goal) = checks("equivalence", args.smoke)

    def progress(fig):
        result.set(one, _cases_figure(fig, fig["worst_one"]), "")
        result.set(together, _cases_figure(fig, fig["worst_all"]), "")

    fig = ce.differential_figures(args.device, cases, tmp, progress=progress)
    result.set(one, _cases_figure(fig, fig["worst_one"]), yes(fig["worst_one"] <= RTOL))
    result.set(together, _cases_figure(fig, fig["worst_all"]), yes(fig["worst_all"] <= RTOL))


def _replay_on_cpu() -> str:
    """--smoke: steps on the CPU replayed by the tests' recorder with a CUDA graph's semantics (in place of
    torch.cuda.CUDAGraph, which needs a CUDA device)."""
    import flatfl.train.step_graph as step_graph
    from graph_replay import RecordedStep

    step_graph.CAPTURES.setdefault("cpu", RecordedStep)
    return "steps replayed by tests/graph_replay.py on the CPU"


def part_graphs(args, result: Result, tmp: Path) -> None:
    import cuda_equivalence as ce
    from combinations import step_graph_combinations

    cases = step_graph_combinations()
    if args.smoke:
        _replay_on_cpu()
        cases = [c for c in cases if c.model == "tiny" and c.reg in ("none", "man") and c.algo in ("fedavg", "fedsam")
                 and c.opt == "sgd"][:1 if args.minimal else 2]
    (check, _), = checks("graphs", args.smoke)

    def figure(fig):
        text = _cases_figure(fig, fig["worst"])
        if fig["eager"]:
            text += f"; {len(fig['eager'])} ran eagerly ({fig['eager'][0][1]})"
        return text

    fig = ce.graphs_figures(args.device, cases, tmp, progress=lambda f: result.set(check, figure(f), ""))
    result.set(check, figure(fig), yes(fig["worst"] <= RTOL and not fig["failed"]))


def part_round_time(args, result: Result, tmp: Path) -> None:
    import gpu_round_time as grt

    if args.smoke:
        _replay_on_cpu()
    res = grt.measure(args.device, rounds=1 if args.smoke else ROUNDS, small=args.smoke, methods=ROUND_METHODS,
                      cuda_graphs=True, tmp=tmp, shape=SMOKE_ROUND_SHAPE if args.smoke else None)
    grt.report(res, "cuda" if args.device.startswith("cuda") else "cpu")
    rows = res["rows"]
    clients, per_round, per_client, epochs, batch, _ = res["shape"]
    shape = f"{clients} clients, {per_round} a round, {epochs} epochs of batch {batch}; median of {res['rounds']}"
    for label in ROUND_METHODS:
        seq, together, graphed = rows[label]
        result.set(f"s/round {label}", f"{graphed:.3f} s graphed; one at a time {seq:.3f} s, together "
                   f"{together:.3f} s ({shape})", yes(graphed <= 0.12))
    ratio = rows["FedAvg + MAN"][2] / rows["FedAvg"][2]
    together = rows["FedAvg + MAN"][1] / rows["FedAvg"][1]
    result.set("s/round FedAvg + MAN / FedAvg", f"{ratio:.2f}x graphed ({together:.2f}x together)", yes(ratio <= 1.10))


def flsam_rows(figures: dict, model_key: str, final: bool) -> list[tuple[str, str]]:
    """The flsam-cost part's (figure, met) of one network, from flsam_cost.py's figures: every method's ratio to
    FedAvg beside FL-SAM's, then every + MAN / without. ``met`` is "" until ``final``."""
    import flsam_cost as fc

    entries = fc.ratios(figures, model_key)
    versus, man, skipped = [], [], []
    ok_versus = ok_man = True
    for label, entry in entries.items():
        if not isinstance(entry, dict):
            skipped.append(f"{label} {entry}")
            continue
        plain = entry.get("none", {})
        if "error" in plain:
            skipped.append(f"{label}: {plain['error']}")
        elif label != "FedAvg" and plain.get("x_fedavg") is not None:
            theirs = entry["flsam_x_fedavg"]
            versus.append(f"{label} {plain['x_fedavg']:.2f}x (FL-SAM {theirs:.2f}x)")
            ok_versus &= plain["x_fedavg"] <= 1.05 * theirs
        if entry["man_x_method"] is not None:
            man.append(f"{label} {entry['man_x_method']:.2f}x")
            ok_man &= entry["man_x_method"] <= 1.10
    fedavg = entries.get("FedAvg")
    base = ""
    if isinstance(fedavg, dict) and "seconds" in fedavg.get("none", {}):
        memory = fedavg["none"]["peak_bytes"]
        base = (f"; FedAvg {fedavg['none']['seconds']:.3f} s/round (FL-SAM {fc.flsam_seconds(model_key, 'FedAvg')} s)"
                + (f", peak {memory / 2**30:.2f} GiB" if memory is not None else ""))
    shape = fc.Shape(*figures["shape"])
    where = (f"; {shape.clients} clients, {shape.per_round} a round, {shape.epochs} epoch(s) of batch "
             f"{shape.batch}, {figures['rounds']} timed round(s)")
    tail = (f"; {'; '.join(skipped)}" if skipped else "") + where
    return [(", ".join(versus) + base + tail if versus else "nothing measured" + tail,
             (yes(ok_versus) if versus else "not measured") if final else ""),
            (", ".join(man) + tail if man else "nothing measured" + tail,
             (yes(ok_man) if man else "not measured") if final else "")]


def part_flsam_cost(args, result: Result, tmp: Path) -> None:
    """benchmarks/flsam_cost.py in a process of its own (on a CPU it forks a child a method), its figures read as it
    writes them, so that a part stopped by its timeout keeps what was measured."""
    figures_path = tmp / "flsam-cost.json"
    command = [sys.executable, str(HERE / "flsam_cost.py"), "--config", "flsam", "--device", args.device,
               "--json", str(figures_path)]
    if args.smoke:
        command += ["--size", "small", "--rounds", "1", "--threads", "1", "--methods", *FLSAM_SMOKE_METHODS,
                    "--models", *[key for key, _ in FLSAM_MODELS[:1 if args.minimal else None]]]
    else:
        command += ["--size", "full", "--rounds", str(FLSAM_ROUNDS)]
    names = [c for c, _ in checks("flsam-cost", args.smoke)]

    def update(final: bool) -> None:
        try:
            figures = json.loads(figures_path.read_text())
        except (OSError, ValueError):
            return
        for i, (key, _) in enumerate(FLSAM_MODELS):
            if key in figures["models"]:
                rows = flsam_rows(figures, key, final)
            elif final:  # --smoke --minimal
                rows = [("not run (--smoke --minimal times the CNN only)", "not measured")] * 2
            else:
                continue
            for check, (figure, met) in zip(names[2 * i:2 * i + 2], rows):
                result.set(check, figure, met)

    print("$ " + " ".join(command), flush=True)
    child = subprocess.Popen(command, cwd=str(ROOT))
    while child.poll() is None:
        time.sleep(2)
        update(False)
    if child.returncode != 0:
        raise SystemExit(f"gpu_check: flsam_cost.py failed (exit {child.returncode}; its output is above)")
    update(True)


def part_hessian(args, result: Result, tmp: Path) -> None:
    import torch

    import hessian_gpu as hg
    from hessian_vs_pyhessian import PyHessianCounter

    inputs, ks, pyhessian_ks, budget = HESSIAN["smoke" if args.smoke else "full"]
    device = torch.device(args.device)
    options = {}
    if args.smoke:  # a small model (the MAN CNN's products take 0.1 s each on a CPU)
        from flatfl.models import build_model

        options = dict(model_fn=lambda: build_model("digits-cnn", num_classes=10, in_channels=3, image_size=8),
                       model_name="digits CNN on 3x8x8 inputs (smoke)", input_shape=(3, 8, 8), classes=10)
    missing = hg.pyhessian_missing()
    hg.say(f"# flatfl Hessian engine vs PyHessian on {args.device}; torch {torch.__version__}; "
           f"PyHessian: {missing or 'installed'}")
    hg.run_size(inputs, device, ks, pyhessian_ks, budget, hg.Clock(device), None if missing else PyHessianCounter(),
                **options)
    rows, targets = dict(hg.ROWS), {what: (met, measured) for what, _, met, measured in hg.TARGETS}
    verdict = {"met": "yes", "MISSED": "no", "not measured": "not measured"}
    names = [c for c, _ in checks("hessian", args.smoke)]
    for check, row, target in ((names[0], f"top-1 ({inputs})", f"top-1 ({inputs})"),
                               (names[1], f"top-{ks[-1]} ({inputs})", f"top-{ks[-1]} ({inputs})"),
                               (names[2], f"trace ({inputs})", f"trace ({inputs})")):
        met, measured = targets[target]
        result.set(check, f"{measured}; {rows[row]}", verdict[met])
    for check, label in ((names[3], "Hutchinson"), (names[4], "Hutch++")):
        met, measured = targets[f"{label} own work ({inputs})"]
        result.set(check, f"{measured} of its time", verdict[met])


def part_table(args, result: Result, tmp: Path) -> None:
    import cuda_equivalence as ce

    (check, _), = checks("table", args.smoke)
    if args.smoke:
        # --minimal: a row of Table 6, whose runs have no spectrum analysis (Table 2's FedAvg has one)
        target, method = ("man-table6", "FedASAM") if args.minimal else ("man-table2", "FedAvg")
        out = ce.reproduce_tables(args.device, 1, tmp, "tiny", target=target,
                                  extra=("--methods", method, "--seeds", "0"))
        reference, what = out, f"tiny preset, {method}, seed 0, compared with itself (no committed tiny table)"
    else:
        reference = ROOT / "reports" / "man-tables-fmnist"
        out = ce.reproduce_tables(args.device, args.workers, tmp, "fmnist", data_dir=args.data_dir)
        what = f"vs {reference.relative_to(ROOT)}"
    if out is None:
        raise SystemExit("gpu_check: flatfl reproduce failed (its error output is above)")
    fig = ce.table_figures(reference, out, args.device)
    text = (f"{fig['values'] - fig['bad']} of {fig['values']} values within their seeds' spread (largest "
            f"difference / sd {fig['worst']:.2f}); {what}")
    if fig["off"]:
        text += f"; off: {', '.join(fig['off'][:3])}" + (" ..." if len(fig["off"]) > 3 else "")
    result.set(check, text, yes(fig["bad"] == 0))


def part_distributed(args, result: Result, tmp: Path) -> None:
    """benchmarks/distributed_scaling.py over every visible GPU (one rank a GPU) against one GPU."""
    import torch

    checks_ = [c for c, _ in checks("distributed", args.smoke)]
    gpus = 0 if args.smoke else torch.cuda.device_count()
    if gpus < 2:
        why = ("the CPU smoke: benchmarks/distributed_scaling.py measures CPU ranks" if args.smoke else
               f"{gpus} GPU visible: several are needed")
        for check in checks_:
            result.set(check, why, "not measured")
        print(f"gpu_check: distributed: {why}", flush=True)
        return
    import distributed_scaling as ds

    for check, (name, one, many, diff, what) in zip(checks_, ds.measure(gpus, "cuda", args.data_dir)):
        result.set(check, f"{one:.2f} s on one GPU, {many:.2f} s on {gpus}: {one / many:.2f}x; {what} within "
                          f"{diff:.1e}", yes(one / many >= 0.8 * gpus and diff <= 1e-4))


PART_FUNCTIONS = {"equivalence": part_equivalence, "graphs": part_graphs, "round-time": part_round_time,
                  "flsam-cost": part_flsam_cost, "hessian": part_hessian, "table": part_table,
                  "distributed": part_distributed}


def run_part(args) -> int:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))  # tests/combinations.py, tests/graph_replay.py
    sys.path.insert(0, str(HERE))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    result = Result(Path(args.result), args.part, args.smoke)
    result.env = dict(torch=torch.__version__, device=_device_name(args.device))
    result.write()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{args.part}-") as d:
        PART_FUNCTIONS[args.part](args, result, Path(d))
    result.complete = True
    result.write()
    print(f"gpu_check: part {args.part} done in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))} ({device})"
    return device


# ----- the parent: the parts under their timeouts, the table ---------------------------------------------------------


def refuse_out(out: Path) -> str | None:
    """Why ``out`` cannot take the check's files (a file; a non-empty folder gpu_check did not make), or None."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a folder"
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).exists():
        return f"--out {out} is a non-empty folder not made by gpu_check (give a new or empty folder)"
    return None


def _versions() -> dict:
    """flatfl's version as this tree has it (flatfl/version.py, read without importing the package, which need not
    be installed on the GPU machine), with the git commit when there is one."""
    import re

    try:
        found = re.search(r'__version__\s*=\s*"([^"]+)"', (ROOT / "flatfl" / "version.py").read_text())
        flatfl_version = found.group(1) if found else "unknown"
    except OSError:
        flatfl_version = "unknown"
    try:
        git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        commit = git.stdout.strip() + (" with local changes" if dirty.stdout.strip() else "") \
            if git.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return dict(flatfl=flatfl_version + (f" (git {commit})" if commit else ""))


def _launch(args, name: str, out: Path, timeout: float, threads: int | None) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--device", args.device,
               "--result", str(out / f"{name}.json"), "--workers", str(args.workers)]
    if args.smoke:
        command.append("--smoke")
    if args.minimal:
        command.append("--minimal")
    if threads:
        command += ["--threads", str(threads)]
    if args.data_dir:
        command += ["--data-dir", args.data_dir]
    log = open(out / f"{name}.log", "w")
    log.write(f"$ {' '.join(command)}   (timeout {timeout:.0f} s)\n")
    log.flush()
    # a session of its own, so that a timeout stops the part's own children too (reproduce's workers)
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True)
    return dict(name=name, proc=proc, log=log, start=time.monotonic(), timeout=timeout, status=None)


def _stop(job: dict) -> None:
    try:
        os.killpg(job["proc"].pid, signal.SIGTERM)
        try:
            job["proc"].wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(job["proc"].pid, signal.SIGKILL)
            job["proc"].wait()
    except ProcessLookupError:
        pass


def _wait(jobs: list[dict]) -> None:
    """Waits for the jobs, stopping each at its timeout; sets each job's ``status`` and ``seconds``. Interrupted
    (Ctrl-C), it stops the jobs still running first."""
    try:
        _poll(jobs)
    except BaseException:
        for j in jobs:
            if j["status"] is None:
                _stop(j)
        raise


def _poll(jobs: list[dict]) -> None:
    while any(j["status"] is None for j in jobs):
        for j in jobs:
            if j["status"] is not None:
                continue
            rc = j["proc"].poll()
            elapsed = time.monotonic() - j["start"]
            if rc is not None:
                j["status"], j["seconds"] = ("ran" if rc == 0 else f"exit {rc}"), elapsed
            elif elapsed > j["timeout"]:
                _stop(j)
                j["status"], j["seconds"] = "timed out", elapsed
            if j["status"] is not None:
                j["log"].write(f"\n[gpu_check: {j['status']} after {elapsed:.0f} s]\n")
                j["log"].close()
        time.sleep(0.2)


def _last_line(path: Path) -> str:
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines()
             if ln.strip() and not ln.startswith("[gpu_check:")]
    return lines[-1][:200] if lines else "no output"


def _rows(job: dict, out: Path, smoke: bool) -> tuple[list[dict], dict]:
    """The part's rows: as it wrote them when it ran to its end, else marked timed out / failed (with what it had
    measured so far, or the last line of its log)."""
    name = job["name"]
    try:
        data = json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        data = dict(rows=[dict(check=c, goal=g, figure="", met="") for c, g in checks(name, smoke)],
                    complete=False, env={})
    rows = data["rows"]
    if job["status"] == "ran" and data["complete"]:
        return rows, data.get("env", {})
    if job["status"] == "timed out":
        met, why = "timed out", f"timed out after {job['seconds']:.0f} s"
    else:
        met, why = "failed", f"{job['status']}: {_last_line(out / f'{name}.log')}"
    for r in rows:
        if r["met"]:  # measured before the part stopped
            continue
        r["figure"] = f"{why}" + (f"; so far: {r['figure']}" if r["figure"] else "")
        r["met"] = met
    return rows, data.get("env", {})


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for the table and the parts' logs (new, empty, or one gpu_check made)")
    ap.add_argument("--smoke", action="store_true", help="the same code paths on the CPU at toy sizes (CI)")
    ap.add_argument("--minimal", action="store_true",
                    help="with --smoke: one equivalence case and one graph case (the test suite's run)")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    ap.add_argument("--data-dir", default=None, help="table part: the folder holding Fashion-MNIST's four files")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for all the parts together (default {DEFAULT_BUDGET} on a GPU)")
    ap.add_argument("--parts", default=None,
                    help="comma-separated parts to run (default: every part but flsam-cost on a GPU, every part "
                         "with --smoke)")
    ap.add_argument("--workers", type=int, default=None, help="table part: runs at once (8 on a GPU)")
    ap.add_argument("--timeout", action="append", default=[], metavar="PART=SECONDS",
                    help="another timeout for a part (still within --budget), e.g. equivalence=400")
    # a child's own options
    ap.add_argument("--part", choices=sorted(PART_FUNCTIONS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.workers = args.workers or (1 if args.smoke else 8)
    if args.minimal and not args.smoke:
        print("gpu_check: error: --minimal is a size of --smoke: give both", file=sys.stderr)
        return 2
    if args.part:
        return run_part(args)

    def fail(line: str, code: int = 2) -> int:
        print(f"gpu_check: error: {line}", file=sys.stderr)
        return code

    if not args.out:
        return fail("--out DIR is needed (the folder for the table and the parts' logs)")
    out = Path(args.out).expanduser().resolve()  # absolute: the parts run from the repository root
    refusal = refuse_out(out)
    if refusal:
        return fail(refusal)
    if args.parts is None:
        args.parts = ",".join(p[0] for p in PARTS if args.smoke or p[0] not in OPT_IN)
    names = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [n for n in names if n not in PART_FUNCTIONS]
    if unknown or not names:
        return fail(f"--parts: unknown part(s) {', '.join(unknown) or '(none given)'}; the parts: "
                    f"{', '.join(p[0] for p in PARTS)}")
    own = {}
    for item in args.timeout:
        name, _, seconds = item.partition("=")
        try:
            own[name] = float(seconds)
        except ValueError:
            own[name] = -1.0
        if name not in PART_FUNCTIONS or own[name] <= 0:
            return fail(f"--timeout {item}: give PART=SECONDS, PART one of {', '.join(p[0] for p in PARTS)}")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return fail("no CUDA device here (python3 benchmarks/gpu_check.py --smoke --out DIR runs the same code "
                        "on the CPU at toy sizes)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER).write_text("made by benchmarks/gpu_check.py\n")
    except OSError as e:
        return fail(f"--out {out} cannot be used: {e.strerror or type(e).__name__}"
                    f"{f' ({e.filename})' if e.filename and str(e.filename) != str(out) else ''}")
    for p in PARTS:
        for suffix in (".log", ".json", ".tmp"):
            (out / f"{p[0]}{suffix}").unlink(missing_ok=True)
    budget = args.budget or (sum(p[2] for p in PARTS if p[3]) + max(p[2] for p in PARTS if not p[3])
                             if args.smoke else DEFAULT_BUDGET)
    started, wall = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    cores = os.cpu_count() or 1
    jobs = []
    alone = [p for p in PARTS if p[3] and p[0] in names]
    together = [p for p in PARTS if not p[3] and p[0] in names]
    def limit(name, full, smoke):
        return max(1.0, min(own.get(name, smoke if args.smoke else full), budget - (time.monotonic() - wall)))

    for name, full, smoke, _ in alone:
        job = _launch(args, name, out, limit(name, full, smoke), 1 if args.smoke else None)
        _wait([job])
        jobs.append(job)
    threads = 1 if args.smoke else max(1, cores // 4)
    batch = [_launch(args, name, out, limit(name, full, smoke), threads) for name, full, smoke, _ in together]
    _wait(batch)
    jobs += batch
    seconds = time.monotonic() - wall

    env, rows = {}, []
    order = {name: i for i, name in enumerate(DISPLAY)}
    for job in sorted(jobs, key=lambda j: order[j["name"]]):
        part_rows, part_env = _rows(job, out, args.smoke)
        rows += [dict(r, part=job["name"]) for r in part_rows]
        env = env or part_env
    versions = _versions()
    device = env.get("device", args.device)
    kind = (f"CPU smoke run{', minimal' if args.minimal else ''} (toy sizes: its timings mean nothing)" if args.smoke
            else "GPU run")
    header = (f"gpu_check {kind}: device {device}, torch {env.get('torch', 'unknown')}, flatfl {versions['flatfl']}, "
              f"{started:%Y-%m-%d %H:%M} UTC, {seconds:.0f} s in all")
    lines = [header, "", "| check | figure | goal | met |", "|---|---|---|---|"]
    lines += [f"| {_cell(r['check'])} | {_cell(r['figure'])} | {_cell(r['goal'])} | {r['met']} |" for r in rows]
    text = "\n".join(lines) + "\n"
    (out / TABLE).write_text(text)
    print(text, end="")
    bad = [f"{j['name']} {j['status']}" for j in jobs if j["status"] != "ran"]
    if bad:
        print(f"gpu_check: {len(bad)} part(s) did not run to their end: {', '.join(bad)} (logs in {out})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
