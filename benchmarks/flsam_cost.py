"""Training cost in FL-SAM's and pfl-research's CIFAR-10 configurations: seconds a round and peak memory, one run.

FL-SAM (harrylee999/FL-SAM, README) publishes seconds a round on one RTX 4090 for CIFAR-10, 100 clients, 10% of
them a round, 5 local epochs of batch 50, SGD lr 0.01, momentum 0.9, weight decay 1e-5, random crop + flip, for its
two-layer CNN and its ResNet-18. This script trains the same seven methods in flatfl (FedAvg, FedDyn, FedSAM, FedSpeed,
FedSMOO, FedLESAM-D = ``fedlesam --lesam-variant d``, FedGMT when it is registered), each without and with MAN, on
CIFAR-10-shaped data (random uint8 images 3x32x32, 10 classes, split iid) and the same two networks: ``flsam-cnn`` (its
``FedAvgNetCIFAR``) and ``resnet18 --model-arg stem=imagenet --model-arg norm=gn`` (its ``resnet18``: the 7x7 stem,
GroupNorm(2, C); tests/test_flsam_models.py). Each method's ratio to FedAvg is printed beside FL-SAM's.

``--config pfl`` is pfl-research's CIFAR-10 benchmark (apple/pfl-research, ``benchmarks/image_classification``:
1000 clients of 50 images, 50 a round, one local epoch of batch 10 = 5 local steps, local SGD lr 0.1, 1500 rounds
on one A100) with the same methods and networks (pfl-research's own ``simple_cnn`` is not one of flatfl's models);
pfl-research publishes no seconds a round for it that this script could set beside flatfl's.

``--size full`` is the published configuration; ``--size small`` a reduced one for a CPU (fewer clients, fewer images
or steps a client; the shapes are printed). On a CPU every method, with and without MAN, trains in a child process of
its own (forked from this one, so that each starts from the same memory and pays no start-up); on CUDA one after the
other in this process, the allocator's peak reset before each. Each times the engine's real round
(``Trainer.run_round``: sampling, per-client data, the method's and MAN's work, aggregation; no evaluation, no files),
one warm-up round, then ``--rounds`` timed rounds, of which the median is printed. The clock: on a CPU the child's CPU
seconds (all its threads; with ``--threads 1`` its compute time, which other jobs on a shared machine do not inflate),
on CUDA wall seconds with synchronisation. Peak memory: on a CPU the growth of the child's resident set (VmHWM minus
VmRSS at its start: data, network, every client's state, the rounds); on CUDA ``torch.cuda.max_memory_allocated``
over the same span, less what was allocated at its start. The methods take flatfl's default hyper-parameters (their
radius, penalty and so on do not change the work a step).

    python benchmarks/flsam_cost.py --size small --threads 1            # both networks, a CPU
    python benchmarks/flsam_cost.py --size full --device cuda           # FL-SAM's configuration on a GPU
    python benchmarks/flsam_cost.py --config pfl --size full --device cuda

Bad options are refused in one line (exit 2). A method that could not run (out of memory, say) gets a row that
says why; ``--json PATH`` also writes the figures as data, after every row.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


class Shape(NamedTuple):
    clients: int
    per_round: int
    per_client: int  # images a client
    epochs: int
    batch: int


#: (config, size) -> shape; the full ones are the published configurations
SHAPES = {("flsam", "full"): Shape(100, 10, 500, 5, 50), ("flsam", "small"): Shape(10, 2, 50, 1, 50),
          ("pfl", "full"): Shape(1000, 50, 50, 1, 10), ("pfl", "small"): Shape(20, 2, 50, 1, 10)}
#: each configuration's local training settings (FL-SAM's README and main.py; pfl-research's baseline.yaml)
SETTINGS = {"flsam": dict(lr=0.01, momentum=0.9, weight_decay=1e-5, lr_decay=0.998, clip=0.0, augment=True),
            "pfl": dict(lr=0.1, momentum=0.0, weight_decay=0.0, lr_decay=1.0, clip=0.0, augment=False)}
CONFIG_NAMES = {"flsam": "FL-SAM's configuration", "pfl": "pfl-research's CIFAR-10 configuration"}

#: the networks: key -> (label, registry name, model options)
MODELS = {"cnn": ("FL-SAM's CNN", "flsam-cnn", {}),
          "resnet18": ("FL-SAM's ResNet-18", "resnet18", {"stem": "imagenet", "norm": "gn"})}
#: the methods: (label, flatfl algorithm, its settings)
METHODS = [("FedAvg", "fedavg", {}), ("FedDyn", "feddyn", {}), ("FedSAM", "fedsam", {}), ("FedSpeed", "fedspeed", {}),
           ("FedSMOO", "fedsmoo", {}), ("FedLESAM-D", "fedlesam", {"lesam_variant": "d"}), ("FedGMT", "fedgmt", {})]
#: FL-SAM's README: seconds a round on one RTX 4090 (CNN, ResNet-18), CIFAR-10, 100 clients, 10 a round, 5 epochs
FLSAM_SECONDS = {"FedAvg": (2.72, 20.10), "FedDyn": (3.01, 20.29), "FedSAM": (7.64, 40.38),
                 "FedSpeed": (8.48, 42.11), "FedSMOO": (9.39, 43.07), "FedLESAM-D": (3.25, 22.32),
                 "FedGMT": (3.21, 23.72)}
#: FL-SAM's README: FedAvg's GPU memory, GB (CNN, ResNet-18)
FLSAM_FEDAVG_MEMORY_GB = (0.93, 1.86)
PFL_PUBLISHED = ("pfl-research: no published seconds a round for this benchmark (its README and benchmark pages give "
                 "none), so no column of theirs")


def flsam_seconds(model_key: str, label: str) -> float | None:
    """FL-SAM's published seconds a round of a method on a network, or None (its configuration only)."""
    published = FLSAM_SECONDS.get(label)
    return None if published is None else published[0 if model_key == "cnn" else 1]


# ----- one method in one child process --------------------------------------------------------------------------


def cpu_name() -> str:
    """The CPU's model name and core count (Linux /proc/cpuinfo), or "CPU"."""
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return f"CPU: {names[0] if names else 'unknown model'}, {os.cpu_count()} core(s) visible"


def _status_kib(field: str) -> int | None:
    """A memory figure of this process from /proc/self/status (Linux), KiB; None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def measure_method(job: dict) -> dict:
    """Builds the run of ``job`` (see :func:`run_job`), trains a warm-up round and ``rounds`` timed rounds, returns
    seconds and peak memory."""
    import torch

    from flatfl.train.config import RunConfig
    from flatfl.train.engine import Trainer
    from train_throughput import cifar_like

    if job["threads"]:
        torch.set_num_threads(job["threads"])
    device = torch.device(job["device"])
    cuda = device.type == "cuda"
    start_kib = _status_kib("VmRSS")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        start_bytes = torch.cuda.memory_allocated(device)
    shape = Shape(*job["shape"])
    ds = cifar_like(shape.clients * shape.per_client)
    cfg = RunConfig(dataset="digits", model=job["model"], model_args=job["model_args"], partition="iid",
                    clients=shape.clients, participation=shape.per_round / shape.clients, sampling="fraction",
                    rounds=10_000, local_epochs=shape.epochs, batch_size=shape.batch, algo=job["algo"],
                    reg=job["reg"], params=job["params"], eval_every=10_000, checkpoint_every=10_000, seed=0,
                    device=job["device"], precision=job["precision"], parallel_clients=job["parallel_clients"],
                    **SETTINGS[job["config"]]).validate()
    notes: list[str] = []
    trainer = Trainer(cfg, Path(job["tmp"]) / f"{job['algo']}-{job['reg']}", quiet=True, dataset=ds,
                      log=notes.append)

    def timed(r: int) -> tuple[float, float]:
        if cuda:
            torch.cuda.synchronize(device)
        wall, cpu = time.perf_counter(), time.process_time()
        trainer.run_round(r)
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - wall, time.process_time() - cpu

    timed(0)
    rounds = [timed(r) for r in range(1, job["rounds"] + 1)]
    peak_kib = _status_kib("VmHWM")
    return dict(wall=[w for w, _ in rounds], cpu=[c for _, c in rounds], parameters=trainer.layout.dim,
                together=trainer.parallel, device=torch.cuda.get_device_name(device) if cuda else cpu_name(),
                peak_bytes=(torch.cuda.max_memory_allocated(device) - start_bytes if cuda else
                            None if peak_kib is None or start_kib is None else (peak_kib - start_kib) * 1024),
                notes=notes)


def attempt(job: dict) -> dict:
    """:func:`measure_method`, or ``{"error": why}`` in one line when it fails (out of memory, say)."""
    try:
        return measure_method(job)
    except Exception as e:  # every failure becomes the row's one line
        text = str(e).strip().splitlines()
        what = "out of memory" if isinstance(e, MemoryError) or "out of memory" in str(e).lower() else \
            f"{type(e).__name__}: {text[0] if text else ''}"
        return dict(error=what[:200])


def _child(job: dict, conn) -> None:
    try:
        conn.send(attempt(job))
    finally:
        conn.close()


def run_job(job: dict) -> dict:
    """One method: on a CPU in a forked child process (its resident set its own), on CUDA in this process (the peak
    of torch's allocator reset before each method; no CUDA context to set up again a method). Its figures, or
    ``{"error": why}``."""
    if job["device"].startswith("cuda"):
        import gc

        import torch

        result = attempt(job)
        gc.collect()
        torch.cuda.empty_cache()
        return result
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(job, send))
    child.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:
        result = None
    child.join()
    if result is None:
        code = child.exitcode
        why = "killed by the system (out of memory?)" if code == -9 else f"exit {code}"
        result = dict(error=f"the child process died: {why}")
    return result


# ----- the parent: every method of every network, the tables ------------------------------------------------------


def clock_seconds(result: dict, device_type: str) -> float:
    """The median timed round: CPU seconds on a CPU, wall seconds on CUDA."""
    return statistics.median(result["wall"] if device_type == "cuda" else result["cpu"])


def mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f}"


def ratios(figures: dict, model_key: str) -> dict:
    """One network's figures, by method label: a line saying why it did not run (a string), or a dict with, for
    ``"none"`` and ``"man"``, either ``{"error": why}`` or ``seconds`` (median s/round), ``x_fedavg`` (over FedAvg's
    s/round without MAN; None without it), ``peak_bytes``; ``man_x_method`` (with MAN over without, or None) and
    ``flsam_x_fedavg`` (FL-SAM's published ratio; None outside its configuration)."""
    rows, device_type = figures["models"][model_key]["rows"], figures["device_type"]
    fedavg = rows.get("FedAvg")
    base = (clock_seconds(fedavg["none"], device_type) if isinstance(fedavg, dict) and "none" in fedavg
            and "error" not in fedavg["none"] else None)
    theirs_base = flsam_seconds(model_key, "FedAvg")
    out: dict = {}
    for label, by_reg in rows.items():
        if not isinstance(by_reg, dict):
            out[label] = by_reg
            continue
        entry: dict = {}
        for reg, r in by_reg.items():
            if "error" in r:
                entry[reg] = dict(error=r["error"])
                continue
            s = clock_seconds(r, device_type)
            entry[reg] = dict(seconds=s, x_fedavg=s / base if base else None, peak_bytes=r["peak_bytes"])
        plain, man = entry.get("none", {}), entry.get("man", {})
        entry["man_x_method"] = man["seconds"] / plain["seconds"] if "seconds" in man and "seconds" in plain \
            else None
        theirs = flsam_seconds(model_key, label) if figures["config"] == "flsam" else None
        entry["flsam_x_fedavg"] = None if theirs is None else theirs / theirs_base
        out[label] = entry
    return out


def table(figures: dict, model_key: str) -> list[str]:
    """The printed table of one network: each method without and with MAN, ratios to FedAvg, FL-SAM's beside."""
    memory = "peak CUDA MiB" if figures["device_type"] == "cuda" else "peak RSS+ MiB"
    published = figures["config"] == "flsam"
    head = (f"{'method':<11} {'s/round':>8} {'x FedAvg':>8} {memory:>13} | {'+MAN s/round':>12} {'x FedAvg':>8} "
            f"{'x method':>8} {memory:>13}")
    if published:
        head += f" | {'FL-SAM s/round':>14} {'x FedAvg':>8}"
    lines = [head]

    def times(x):
        return f"{x:>7.2f}x" if x is not None else f"{'':>8}"

    for label, entry in ratios(figures, model_key).items():
        if not isinstance(entry, dict):
            lines.append(f"{label:<11} {entry}")
            continue
        cells = []
        for reg in ("none", "man"):
            r = entry.get(reg)
            if r is None or "error" in r:
                cells.append("not run" if r is None else r["error"])
            elif reg == "none":
                cells.append(f"{r['seconds']:>8.3f} {times(r['x_fedavg'])} {mib(r['peak_bytes']):>13}")
            else:
                cells.append(f"{r['seconds']:>12.3f} {times(r['x_fedavg'])} {times(entry['man_x_method'])} "
                             f"{mib(r['peak_bytes']):>13}")
        line = f"{label:<11} {cells[0]:<{8 + 1 + 8 + 1 + 13}} | {cells[1]:<{12 + 1 + 8 + 1 + 8 + 1 + 13}}"
        if entry["flsam_x_fedavg"] is not None:
            line += f" | {flsam_seconds(model_key, label):>14.2f} {entry['flsam_x_fedavg']:>7.2f}x"
        lines.append(line.rstrip())
    return lines


def describe(figures: dict) -> list[str]:
    """The header: machine, torch, configuration, shape, clock, memory, what is FL-SAM's."""
    shape = Shape(*figures["shape"])
    device_type = figures["device_type"]
    clock = ("wall seconds with CUDA synchronisation" if device_type == "cuda" else
             f"CPU seconds of the child process ({figures['threads'] or 'default'} torch thread(s))")
    memory = ("torch.cuda.max_memory_allocated" if device_type == "cuda" else
              "growth of the child's resident set, VmHWM - VmRSS at its start")
    settings = SETTINGS[figures["config"]]
    lines = [f"{figures['device']}, torch {figures['torch']}, {figures['precision']}; {CONFIG_NAMES[figures['config']]}"
             f" ({figures['size'].upper()} size{'' if figures['size'] == 'full' else ', not the published one'}): "
             f"{shape.clients} clients of {shape.per_client} CIFAR-10-shaped images (random, 10 classes, iid), "
             f"{shape.per_round} a round, {shape.epochs} local epoch(s) of batch {shape.batch}; SGD lr {settings['lr']}"
             f", momentum {settings['momentum']}, weight decay {settings['weight_decay']}, "
             f"{'random crop + flip' if settings['augment'] else 'no augmentation'}",
             f"s/round: median of {figures['rounds']} round(s) after a warm-up round, {clock}; peak memory: {memory}",
             "x FedAvg: the row's s/round over FedAvg's (without MAN); x method: with MAN over the same method "
             "without"]
    if figures["config"] == "flsam":
        lines.append("FL-SAM s/round: its README (one RTX 4090, CIFAR-10, 100 clients, 10 a round, 5 epochs of "
                     f"batch 50); its FedAvg's GPU memory: {FLSAM_FEDAVG_MEMORY_GB[0]} GB (CNN), "
                     f"{FLSAM_FEDAVG_MEMORY_GB[1]} GB (ResNet-18)")
    else:
        lines.append(PFL_PUBLISHED)
    return lines


def model_line(figures: dict, model_key: str) -> str:
    label, name, options = MODELS[model_key]
    data = figures["models"][model_key]
    opts = "".join(f", {k}={v}" for k, v in options.items())
    together = {r.get("together") for by_reg in data["rows"].values() if isinstance(by_reg, dict)
                for r in by_reg.values() if "together" in r}
    mode = ", ".join(f"{t} client(s) trained at once" for t in sorted(together, key=str)) or "nothing trained"
    params = f"{data['parameters']:,} parameters" if data.get("parameters") else "parameters n/a"
    return f"{label} ({name}{opts}; {params}; {mode})"


def latest_models_line(figures: dict, model_key: str) -> str:
    """What keeping every client's latest model (flatfl's round state: clients x parameters) takes, at this size and
    at the configuration's full size: the floor of every method's memory."""
    dim = figures["models"][model_key].get("parameters")
    if not dim:
        return ""
    width = 8 if figures["precision"] == "float64" else 4
    here, full = Shape(*figures["shape"]).clients, SHAPES[(figures["config"], "full")].clients
    return (f"every client's latest model is kept: {here} x {dim:,} x {width} bytes = "
            f"{here * dim * width / 2**30:.2f} GiB at this size; {full * dim * width / 2**30:.2f} GiB at the full "
            f"size ({full} clients)")


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="flsam", help="flsam (FL-SAM's configuration) or pfl (pfl-research's)")
    ap.add_argument("--size", default="small", help="full (the published configuration) or small (a CPU's)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), help=f"of {', '.join(MODELS)} (default: both)")
    ap.add_argument("--methods", nargs="+", default=None,
                    help=f"of {', '.join(m[0] for m in METHODS)}, any case (default: all)")
    ap.add_argument("--rounds", default="2", help="timed rounds a method, after a warm-up round (median printed)")
    ap.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when there is one, else cpu)")
    ap.add_argument("--threads", default=None, help="torch threads in each child (default: torch's)")
    ap.add_argument("--precision", default="float32", help="float32 or float64")
    ap.add_argument("--parallel-clients", default=None,
                    help="clients trained at once: 'all' or a count (default: flatfl's, all on CUDA, 1 elsewhere)")
    ap.add_argument("--json", default=None, help="also write the figures here (JSON), after every row")
    return ap.parse_args(argv)


def check(args) -> str | None:
    """Why the options cannot run (one line), or None; normalises them in place."""
    from flatfl.errors import ConfigError
    from flatfl.train.config import parallel_clients_value

    if args.config not in SHAPES_CONFIGS:
        return f"--config must be one of {', '.join(SHAPES_CONFIGS)}, got {args.config!r}"
    if args.size not in ("small", "full"):
        return f"--size must be small or full, got {args.size!r}"
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        return f"--models: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(MODELS)}"
    args.models = list(dict.fromkeys(args.models))
    if args.methods is not None:
        names = {label.lower(): label for label, _, _ in METHODS}
        chosen = [names.get(m.lower()) for m in args.methods]
        if None in chosen:
            bad = [m for m, c in zip(args.methods, chosen) if c is None]
            return (f"--methods: unknown {', '.join(map(repr, bad))}; choose from "
                    f"{', '.join(m[0] for m in METHODS)}")
        args.methods = list(dict.fromkeys(chosen))
    for name in ("rounds", "threads"):
        value = getattr(args, name)
        if value is None:
            continue
        if not str(value).isdigit() or not 1 <= int(value) <= 1000:
            return f"--{name} must be an integer from 1 to 1000, got {value!r}"
        setattr(args, name, int(value))
    if args.precision not in ("float32", "float64"):
        return f"--precision must be float32 or float64, got {args.precision!r}"
    try:
        args.parallel_clients = parallel_clients_value(args.parallel_clients)
    except ConfigError as e:
        return str(e)
    import torch

    if args.device is None:
        args.device = "cuda" if os.environ.get("CUDA_VISIBLE_DEVICES", None) != "" and _cuda_count() else "cpu"
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        return f"--device must be cpu or cuda[:N], got {args.device!r}"
    if device.type not in ("cpu", "cuda"):
        return f"--device must be cpu or cuda[:N], got {args.device!r}"
    if device.type == "cuda" and not _cuda_count():
        return "--device cuda: no CUDA device here"
    if args.json:
        target = Path(args.json)
        if target.is_dir() or not target.parent.is_dir():
            return f"--json {args.json}: give a file in an existing folder"
    return None


SHAPES_CONFIGS = tuple(dict.fromkeys(config for config, _ in SHAPES))


def _cuda_count() -> int:
    """CUDA devices (torch counts them through NVML where it can, without initialising CUDA); 0 without CUDA."""
    import torch

    if not torch.backends.cuda.is_built():
        return 0
    try:
        return torch.cuda.device_count()
    except RuntimeError:
        return 0


def main(argv=None) -> int:
    args = parse(argv)
    problem = check(args)
    if problem:
        print(f"flsam_cost: error: {problem}", file=sys.stderr)
        return 2
    import torch

    from flatfl.train.catalog import load_all
    from flatfl.train.components import ALGORITHMS

    load_all()
    device_type = torch.device(args.device).type
    methods = [m for m in METHODS if args.methods is None or m[0] in args.methods]
    figures = dict(config=args.config, size=args.size, shape=list(SHAPES[(args.config, args.size)]),
                   rounds=args.rounds, device=args.device, device_type=device_type, torch=torch.__version__,
                   threads=args.threads, precision=args.precision, models={}, complete=False)

    def save() -> None:
        if args.json:
            tmp = Path(args.json).with_suffix(".tmp")
            tmp.write_text(json.dumps(figures))
            os.replace(tmp, args.json)

    with tempfile.TemporaryDirectory(prefix="flsam-cost-") as tmp:
        for model_key in args.models:
            _, name, options = MODELS[model_key]
            data = figures["models"].setdefault(model_key, dict(rows={}, parameters=None))
            for label, algo, params in methods:
                if algo not in ALGORITHMS:
                    data["rows"][label] = f"not registered (no '{algo}' in this flatfl)"
                    save()
                    continue
                for reg in ("none", "man"):
                    job = dict(config=args.config, shape=figures["shape"], model=name, model_args=options, algo=algo,
                               reg=reg, params=params, rounds=args.rounds, device=args.device, threads=args.threads,
                               precision=args.precision, parallel_clients=args.parallel_clients, tmp=tmp)
                    result = run_job(job)
                    data["rows"].setdefault(label, {})[reg] = result
                    if "error" not in result:
                        data["parameters"] = result["parameters"]
                        figures["device"] = result["device"]
                        seconds = f"{clock_seconds(result, device_type):.3f} s/round"
                    else:
                        seconds = result["error"]
                    print(f"  {model_key} {label}{' + MAN' if reg == 'man' else ''}: {seconds}", file=sys.stderr,
                          flush=True)
                    save()
        figures["complete"] = True
        save()
    print("\n".join(describe(figures)))
    for model_key in args.models:
        print()
        print(model_line(figures, model_key))
        print(latest_models_line(figures, model_key))
        print("\n".join(table(figures, model_key)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
