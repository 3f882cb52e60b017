"""``flatfl reproduce``: every training, analysis and the report behind one paper table, in one command.

Targets (the layouts of :data:`flatfl.report.tables.TABLES`):

* ``man-table2``: FedAvg, FedSAM, FedDyn, FedDC, each with and without MAN, Dirichlet delta 0.3 and 0.6
  (MAN Table 2: top Hessian eigenvalue and trace; MAN Fig. 4 for the FedAvg and FedSAM pairs);
* ``man-table6``: FedASAM and FedSpeed with and without MAN (MAN supplementary Table 6);
* ``man-tables``: both MAN tables (24 runs); the runs of a preset live in one folder, so running ``man-table2`` then
  ``man-table6`` trains nothing twice;
* ``fedalign-table1``: FedAvg, FedProx, MOON, and FedAvg with Mixup, StochDepth, GradAug and FedAlign on the FedML
  Dirichlet 0.5 split, with cross-client H_N / H_D (FedAlign Table 1).

Presets (:data:`PRESETS`):

* ``paper``: the papers' settings. MAN (paper Sec. 4, supplementary Sec. 7, spec/algorithms.md §0): CIFAR-100 and
  the MAN CNN, 100 clients, each joining a round with probability 0.1, 500 rounds, lr 0.1 decayed by 0.998 per
  round, batch 50, 5 local epochs, weight decay 1e-3, gradient clipping at 10; zeta 0.15 (main paper, for CIFAR-100)
  except FedAvg+MAN, zeta 0.6 (supplementary Sec. 7), in the fedMAN code's convention (loss = CE + zeta/2 * sum);
  FedDyn and FedDC alpha 0.01; FedSAM rho 0.05; FedASAM rho 0.5, eta 0.2; FedSpeed rho 0.1, lambda 0.01.
  Hessian: PyHessian's protocol (spec/algorithms.md §21: power iteration and Hutchinson, 100 iterations, tol 1e-3,
  the whole training set), and for MAN Fig. 4 the top 200 eigenvalues (Lanczos) and the spectral density.
  FedAlign (paper Sec. 3.2, spec §18-19): CIFAR-100, ResNet-56, 16 clients all participating, FedML Dirichlet 0.5,
  25 rounds x 20 local epochs, lr 0.01 (constant), momentum 0.9 Nesterov, weight decay 1e-4, batch 64; FedProx
  mu 1e-4, MOON mu 1 tau 0.5, Mixup gamma 0.1, StochDepth last survival 0.9, GradAug mu 1.75 with 2 sub-networks
  and minimum width 0.8, FedAlign mu 0.45 width 0.25 (clipping at 10 for FedAlign as in its code, none for the
  others); H_N / H_D with the ``fedalign`` protocol; loss surfaces along the top-2 Hessian eigenvectors (Fig. 1).
  Needs the dataset (``--data-dir``) and, realistically, a GPU (``--device cuda``).
* ``quick``: the same grids scaled down to the embedded digits (1,797 8x8 images) on a laptop CPU, three seeds
  (0, 1, 2) by default: MAN with the digits CNN, 20 clients joining with probability 0.5 (10 per round, as in the
  paper), 30 rounds x 2 local epochs, the paper's optimiser settings and hyper-parameters; Hessian by Lanczos (top
  eigenvalue) and Hutch++ (trace, 60 Hessian-vector products) on the whole digits training split (1,442 images);
  for the Fig. 4 pairs the top 50 eigenvalues and the density (2 SLQ starts x 80 steps) of the first seed only.
  Sized so that ``man-tables`` (72 runs) takes about 10-12 minutes on 2 quiet cores with the default 2 workers
  (README). FedAlign with ResNet-20 on digits, 16 clients, 10 rounds x 2 local epochs.
* ``tiny``: the same grids for seconds-long tests (2 rounds, 4 clients, a few probes).

Which code each preset follows (:data:`CODE_FOLLOWED`; the same in every preset, since a table's numbers come from
one code). The MAN tables were produced with the fedMAN code, so every MAN run follows it:

=========  ===========================================================================================================
FedAvg     fedMAN/FedDyn ``train_FedAvg``: flatfl's ``fedavg`` is that code (no switch)
FedSAM     fedMAN ``man_code_sam`` SAM minimiser: flatfl's SAM (no switch)
FedASAM    fedMAN ``man_code_sam`` ASAM minimiser: flatfl's ASAM (no switch)
FedDyn     fedMAN ``train_feddyn_mdl``: flatfl's ``feddyn`` (no switch)
FedDC      fedMAN/FedDC ``train_FedDC``: ``--cv-lr initial`` (the code divides the g_i update by the undecayed lr)
           and ``--steps-rule mean`` (by ``E * ceil(mean(n) / B)``; identical to the default on the equal-size
           Dirichlet split, set so the run is the code's on any split); flatfl's defaults are the papers' intent
FedSpeed   fedMAN ``train_model_speed`` (lambda = alpha / w_i); its speedOpt's leftover gradient in the ascent step
           (no ``zero_grad``) is a bug and is not reproduced
MAN        fedMAN's penalty, loss = CE + (zeta/2) sum_l mean(a_l^2) over the same post-ReLU activations
=========  ===========================================================================================================

FedAlign Table 1 follows the FedAlign code (FedML-based): its partition, optimiser, clipping for FedAlign only, and
the ``fedalign`` protocol of H_N / H_D. It has no SCAFFOLD or FedDC run, so ``--cv-lr`` / ``--steps-rule`` do not
arise; SCAFFOLD used elsewhere (``flatfl train``) keeps flatfl's defaults unless asked.

Layout: the runs in ``RUNS_DIR/<method>-<partition>-s<seed>/`` (default ``runs/reproduce-<preset>``), the report in
``OUT`` (default ``reports/<target>-<preset>``). Re-running skips finished runs and analyses and resumes unfinished
runs, so an interrupted reproduction continues where it stopped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import ConfigError
from .sweep import RunTask, run_tasks

__all__ = ["TARGETS", "PRESETS", "CODE_FOLLOWED", "FEDDC_OFFICIAL", "plan", "reproduce", "Method"]

PRESETS = ("tiny", "quick", "paper")
#: seeds when ``--seeds`` is not given: the quick preset's tables show mean +- sd over three seeds; one paper run
#: takes GPU-days; tiny is for tests
DEFAULT_SEEDS = {"tiny": (0,), "quick": (0, 1, 2), "paper": (0,)}
#: torch threads per run when ``--threads`` is not given: fixed, not taken from the machine's load, because the
#: thread count changes the order of floating-point sums and so the numbers (see README, "Reproducing")
REPRODUCE_THREADS = 1
TARGETS = ("man-table2", "man-table6", "man-tables", "fedalign-table1")


@dataclass(frozen=True)
class Method:
    """One row of a table: its name, the settings that make it (RunConfig fields and hyper-parameter flags), and
    whether its runs get the top-k spectrum and density (MAN Fig. 4)."""

    label: str
    settings: dict = field(default_factory=dict)
    spectrum: bool = False


#: FedDC as the fedMAN/FedDC code ran it (see CODE_FOLLOWED): the undecayed lr and the mean-size step count in the
#: g_i update. flatfl's defaults (``current``, ``own``) are the papers' intent.
FEDDC_OFFICIAL = {"cv_lr": "initial", "steps_rule": "mean"}

#: Per method of the tables: the code whose behaviour every preset follows, and what that takes here.
CODE_FOLLOWED = {
    "FedAvg": "fedMAN/FedDyn train_FedAvg (sample-weighted server mean): flatfl's fedavg, no switch needed",
    "FedSAM": "fedMAN man_code_sam SAM minimiser (clip 10 before and after the ascent): flatfl's SAM, no switch",
    "FedASAM": "fedMAN man_code_sam ASAM minimiser (T_w on weights only): flatfl's ASAM, no switch",
    "FedDyn": "fedMAN train_feddyn_mdl (alpha / w_i, the quadratic as weight decay): flatfl's feddyn, no switch",
    "FedDC": "fedMAN/FedDC train_FedDC: --cv-lr initial (undecayed lr in the g_i update) and --steps-rule mean "
             "(divides by E * ceil(mean(n) / B)); the same as 'own' on the equal-size Dirichlet split",
    "FedSpeed": "fedMAN train_model_speed (lambda = alpha / w_i): flatfl's fedspeed, except that speedOpt's "
                "leftover gradient in the ascent (no zero_grad) is not reproduced; it is a bug, not a setting",
    "MAN": "fedMAN's penalty, CE + (zeta / 2) * sum_l mean(a_l^2) over the post-ReLU activations",
    "FedAlign table": "the FedAlign code (FedML): FedProx, MOON, Mixup, StochDepth, GradAug, FedAlign as there; H_N / "
                      "H_D with its 'fedalign' protocol; no SCAFFOLD or FedDC in the table",
}


def _man_methods() -> dict[str, list[Method]]:
    zeta, zeta_fedavg = 0.15, 0.6  # main paper Sec. 4 (CIFAR-100); supplementary Sec. 7 (FedAvg+MAN)

    def pair(label, settings, spectrum=False):
        return [Method(label, settings, spectrum),
                Method(f"{label}+MAN", dict(settings, reg="man", zeta=zeta_fedavg if label == "FedAvg" else zeta),
                       spectrum)]

    table2 = (pair("FedAvg", {"algo": "fedavg"}, spectrum=True)
              + pair("FedSAM", {"algo": "fedsam", "rho": 0.05}, spectrum=True)
              + pair("FedDyn", {"algo": "feddyn", "feddyn_alpha": 0.01})
              + pair("FedDC", {"algo": "feddc", "feddc_alpha": 0.01, **FEDDC_OFFICIAL}))
    table6 = (pair("FedASAM", {"algo": "fedasam", "rho": 0.5, "eta": 0.2})
              + pair("FedSpeed", {"algo": "fedspeed", "rho": 0.1, "fedspeed_lambda": 0.01}))
    return {"man-table2": table2, "man-table6": table6}


def _fedalign_methods() -> list[Method]:
    return [
        Method("FedAvg", {"algo": "fedavg"}),
        Method("FedProx", {"algo": "fedprox", "mu": 1e-4}),
        Method("MOON", {"algo": "moon", "moon_mu": 1.0, "moon_tau": 0.5}),
        Method("FedAvg+Mixup", {"algo": "fedavg", "reg": "mixup", "mixup_gamma": 0.1}),
        Method("FedAvg+StochDepth", {"algo": "fedavg", "reg": "stochdepth", "survival_last": 0.9}),
        Method("FedAvg+GradAug", {"algo": "fedavg", "reg": "gradaug", "gradaug_mu": 1.75, "num_subnets": 2,
                                  "width": 0.8}),
        Method("FedAvg+FedAlign", {"algo": "fedavg", "reg": "fedalign", "fedalign_mu": 0.45, "width": 0.25,
                                   "clip": 10.0}),  # FedAlign's code clips at 10 (spec §18)
    ]


# Settings per preset. 'run' = RunConfig fields shared by every run; 'hessian' = run_hessian options for the table;
# 'spectrum' = run_hessian options for the Fig. 4 pages; 'clients' = run_client_metrics options; 'surface' =
# run_surface options (None: not computed).
_MAN = {
    "paper": {
        "run": dict(dataset="cifar100", model="cifar-cnn", clients=100, participation=0.1, sampling="bernoulli",
                    partition="dirichlet", rounds=500, local_epochs=5, batch_size=50, lr=0.1, lr_decay=0.998,
                    weight_decay=1e-3, clip=10.0, eval_every=5, checkpoint_every=10),
        "hessian": dict(top=1, method="power", tol=1e-3, trace=True, trace_method="pyhessian", trace_hvps=100,
                        samples=None, batch_size=50),
        "spectrum": dict(top=200, method="lanczos", tol=1e-3, trace=False, density=True, density_steps=100,
                         density_starts=4, samples=None, batch_size=256),
    },
    "quick": {  # sized for <= 15 min on 2 quiet cores with 3 seeds (README, "The quick reproduction")
        "run": dict(dataset="digits", model="digits-cnn", clients=20, participation=0.5, sampling="bernoulli",
                    partition="dirichlet", rounds=30, local_epochs=2, batch_size=50, lr=0.1, lr_decay=0.998,
                    weight_decay=1e-3, clip=10.0, eval_every=5, checkpoint_every=10),
        "hessian": dict(top=1, method="lanczos", tol=1e-3, trace=True, trace_method="hutchpp", trace_hvps=60,
                        trace_rtol=0.01, samples=None, batch_size=512),
        "spectrum": dict(top=50, method="lanczos", tol=1e-3, trace=False, density=True, density_steps=80,
                         density_starts=2, samples=None, batch_size=512),
        "spectrum_seeds": "first",  # the Fig. 4 spectrum of the first seed only: 45 s a run, the largest cost
    },
    "tiny": {
        "run": dict(dataset="digits", model="digits-cnn", clients=4, participation=1.0, sampling="bernoulli",
                    partition="dirichlet", rounds=2, local_epochs=1, batch_size=50, lr=0.1, lr_decay=0.998,
                    weight_decay=1e-3, clip=10.0, eval_every=1, checkpoint_every=1),
        "hessian": dict(top=1, method="lanczos", tol=1e-2, trace=True, trace_method="hutchpp", trace_hvps=9,
                        trace_rtol=None, samples=96, batch_size=96),
        "spectrum": dict(top=3, method="lanczos", tol=1e-2, trace=False, density=True, density_steps=6,
                         density_starts=2, samples=96, batch_size=96),
    },
}
_FEDALIGN = {
    "paper": {
        "run": dict(dataset="cifar100", model="resnet56", clients=16, participation=1.0, sampling="fraction",
                    partition="fedml-dirichlet", alpha=0.5, rounds=25, local_epochs=20, batch_size=64, lr=0.01,
                    lr_decay=1.0, momentum=0.9, nesterov=True, weight_decay=1e-4, clip=0.0, eval_every=1,
                    checkpoint_every=1, save_clients=True),
        "hessian": dict(top=1, method="power", tol=1e-3, trace=True, trace_method="pyhessian", trace_hvps=100,
                        samples=None, batch_size=64),
        "clients": dict(protocol="fedalign", probes=100, tol=1e-3),
        "surface": dict(directions="hessian", grid=21, range=1.0, samples=2560, batch_size=256),
    },
    "quick": {
        "run": dict(dataset="digits", model="resnet20", clients=16, participation=1.0, sampling="fraction",
                    partition="fedml-dirichlet", alpha=0.5, rounds=10, local_epochs=2, batch_size=64, lr=0.01,
                    lr_decay=1.0, momentum=0.9, nesterov=True, weight_decay=1e-4, clip=0.0, eval_every=1,
                    checkpoint_every=5, save_clients=True),
        "hessian": dict(top=1, method="lanczos", tol=1e-3, trace=True, trace_method="hutchpp", trace_hvps=40,
                        trace_rtol=0.02, samples=512, batch_size=256),
        "clients": dict(protocol="default", probes=20, groups=5, samples=64),
        "surface": dict(directions="hessian", grid=9, range=1.0, samples=256, batch_size=256),
    },
    "tiny": {
        "run": dict(dataset="digits", model="resnet20", clients=4, participation=1.0, sampling="fraction",
                    partition="fedml-dirichlet", alpha=0.5, rounds=1, local_epochs=1, batch_size=64, lr=0.01,
                    lr_decay=1.0, momentum=0.9, nesterov=True, weight_decay=1e-4, clip=0.0, eval_every=1,
                    checkpoint_every=1, save_clients=True),
        "hessian": dict(top=1, method="lanczos", tol=1e-2, trace=True, trace_method="hutchpp", trace_hvps=6,
                        trace_rtol=None, samples=32, batch_size=32),
        "clients": dict(protocol="default", probes=4, groups=2, samples=16),
        "surface": dict(directions="random", grid=3, range=0.5, samples=32, batch_size=32),
    },
}
MAN_ALPHAS = (0.3, 0.6)


def _slug(label: str) -> str:
    return label.lower().replace("+", "-")


def _run_name(label: str, settings: dict, seed: int) -> str:
    part = settings["partition"]
    part = part if part == "iid" else f"{part}{float(settings['alpha']):g}"
    return f"{_slug(label)}-{part}-s{seed}"


def plan(target: str, preset: str = "quick", *, runs_dir: str | Path | None = None, seeds=None,
         device: str = "cpu", data_dir: str | None = None, threads: int | None = None,
         model: str | None = None) -> list[RunTask]:
    """The run tasks of ``target`` at ``preset``: one per (method, partition, seed), with its analyses.

    ``model``: the model the Hessian analyses measure, 'server' or 'clients-average'; default the one the table
    reports (:func:`flatfl.report.tables.model_for`: the all-clients average for the MAN tables, the server model
    for FedAlign's)."""
    if target not in TARGETS:
        raise ConfigError(f"unknown reproduction target {target!r}: choose one of {', '.join(TARGETS)}")
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}")
    seeds = DEFAULT_SEEDS[preset] if seeds is None else tuple(seeds)
    if not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise ConfigError(f"--seeds must be non-negative integers, got {seeds!r}")
    root = Path(runs_dir or Path("runs") / f"reproduce-{preset}").resolve()
    extra = {"device": device}
    if data_dir:
        extra["data_dir"] = str(Path(data_dir).expanduser().resolve())
    from .report.tables import TABLES, model_for

    model = model_for(TABLES["fedalign-table1" if target == "fedalign-table1" else "man-table2"], model)
    tasks: list[RunTask] = []
    if target.startswith("man-"):
        cfg = _MAN[preset]
        methods = _man_methods()
        keys = ("man-table2", "man-table6") if target == "man-tables" else (target,)
        for key in keys:
            for m in methods[key]:
                for alpha in MAN_ALPHAS:
                    for seed in seeds:
                        settings = dict(cfg["run"], alpha=alpha, seed=seed, **m.settings, **extra)
                        with_spectrum = cfg.get("spectrum_seeds") != "first" or seed == seeds[0]
                        tasks.append(_task(m, settings, seed, root, cfg, device, threads, model, with_spectrum))
    else:
        cfg = _FEDALIGN[preset]
        for m in _fedalign_methods():
            for seed in seeds:
                settings = dict(cfg["run"], seed=seed, **extra)
                settings.update(m.settings)
                tasks.append(_task(m, settings, seed, root, cfg, device, threads, model))
    return tasks


def _task(m: Method, settings: dict, seed: int, root: Path, cfg: dict, device: str, threads,
          model: str = "server", with_spectrum: bool = True) -> RunTask:
    from .train.config import normalize_settings

    name = _run_name(m.label, settings, seed)
    hessian = dict(cfg["hessian"], seed=seed, device=device)
    spectrum = dict(cfg["spectrum"], seed=seed, device=device) if m.spectrum and with_spectrum and "spectrum" in cfg \
        else None
    clients = dict(cfg["clients"], seed=seed, device=device) if cfg.get("clients") else None
    surface = dict(cfg["surface"], seed=seed, device=device) if cfg.get("surface") else None
    return RunTask(name=name, run_dir=str(root / name), settings=normalize_settings(settings, source=name),
                   hessian=hessian, spectrum=spectrum, clients=clients, surface=surface, threads=threads,
                   model=model)


def reproduce(target: str, preset: str = "quick", *, out: str | Path | None = None,
              runs_dir: str | Path | None = None, executor=None, seeds=None, device: str = "cpu",
              data_dir: str | None = None, threads: int | None = None,
              echo: Callable[[str], None] | None = None, model: str | None = None) -> dict:
    """Train and analyse every run of ``target`` at ``preset`` (skipping finished work), then write the report
    into ``out``. Returns the report's summary plus 'tasks' (what each run did) and 'seconds'.

    ``seeds``: default :data:`DEFAULT_SEEDS` of the preset. ``threads``: torch threads per run, default
    :data:`REPRODUCE_THREADS` (pinned, whatever the machine's load; recorded in each run's config.json)."""
    from .executors import LocalExecutor
    from .report import build_report

    from .utils.threads import check_threads

    check_threads(threads)
    start = time.perf_counter()
    executor = executor or LocalExecutor(1)
    if threads is None:
        threads = REPRODUCE_THREADS
    tasks = plan(target, preset, runs_dir=runs_dir, seeds=seeds, device=device, data_dir=data_dir, threads=threads,
                 model=model)
    out = Path(out or Path("reports") / f"{target}-{preset}")
    if echo:
        echo(f"{target} ({preset}): {len(tasks)} runs in {Path(tasks[0].run_dir).parent}, report in {out}")
    records = run_tasks(tasks, executor, echo=echo)
    failed = [r for r in records if r.get("error")]
    tables = ("man-table2", "man-table6") if target == "man-tables" else (target,)
    done = [t.run_dir for t in tasks if Path(t.run_dir, "config.json").is_file()]
    if not done:
        raise ConfigError(f"no run of {target} could start; first error: {failed[0]['error'] if failed else '?'}")
    summary = build_report(done, out, tables=tables, title=f"flatfl reproduce {target} --preset {preset}",
                           echo=echo, model=model)
    summary["tasks"] = records
    summary["failed"] = [f"{r['name']}: {r['error']}" for r in failed]
    summary["seconds"] = round(time.perf_counter() - start, 1)
    return summary
