"""What the MAN tables (Table 2, supplementary Table 6) share: the paper's scale, the presets' settings, the
deltas, the zetas and FedDC's code switches. Not a table itself (it defines no ``TABLE``)."""
from __future__ import annotations

from .table_spec import Method

MAN_SCALE = ("paper: CIFAR-100, CNN (2 conv + 3 FC), 100 clients, 10% participation, 500 rounds x 5 local epochs, "
             "Hessian on the training set (assumed PyHessian protocol)")
ALPHAS = (0.3, 0.6)  # Dirichlet delta of every MAN run
ZETA, ZETA_FEDAVG = 0.15, 0.6  # main paper Sec. 4 (CIFAR-100); supplementary Sec. 7 (FedAvg+MAN)
#: FedDC as the fedMAN/FedDC code ran it (man_table2: code_followed): the undecayed lr and the mean-size step count in the
#: g_i update. flatfl's defaults (``current``, ``own``) are the papers' intent.
FEDDC_OFFICIAL = {"cv_lr": "initial", "steps_rule": "mean"}
#: the floating type of the CPU presets' runs (quick, fmnist, fmnist-cnn): float64, so that the same command gives
#: the same numbers on any CPU (docs/reproductions.md, "Same numbers"); the paper presets keep the papers' float32
CPU_PRECISION = "float64"
#: the MAN paper's accuracies (its Table 1, 'accuracy_after_500_rounds'), set beside the rows of its other tables
MAN_ACCURACIES = ("MAN", "Table 1")
MAN_CODE = {"MAN": "fedMAN's penalty, CE + (zeta / 2) * sum_l mean(a_l^2) over the post-ReLU activations"}


def pair(label: str, settings: dict, spectrum: bool = False) -> tuple[Method, Method]:
    """A method without and with MAN (FedAvg+MAN at zeta 0.6, the others at 0.15)."""
    return (Method(label, settings, spectrum),
            Method(f"{label}+MAN", dict(settings, reg="man", zeta=ZETA_FEDAVG if label == "FedAvg" else ZETA),
                   spectrum))


#: the fmnist preset: Fashion-MNIST with an MLP, real images, 72 runs with 3 seeds (docs/reproductions.md,
#: "Fashion-MNIST", says what it costs); fmnist-cnn is the same with the paper's CNN family
_FMNIST = {
    "run": dict(dataset="fashion-mnist", model="mlp", model_args={"hidden": [64, 64]}, clients=100,
                participation=0.1, sampling="bernoulli", partition="dirichlet", rounds=20, local_epochs=2,
                batch_size=50, lr=0.1, lr_decay=0.998, weight_decay=1e-3, clip=10.0, eval_every=10,
                checkpoint_every=10, precision=CPU_PRECISION),
    "hessian": dict(top=1, method="lanczos", tol=1e-3, trace=True, trace_method="hutchpp", trace_hvps=40,
                    trace_rtol=0.02, samples=2000, batch_size=1000),
    "spectrum": dict(top=20, method="lanczos", tol=1e-3, trace=False, density=True, density_steps=40,
                     density_starts=2, samples=1000, batch_size=1000),
    "spectrum_seeds": "first",
}

# Settings per preset (flatfl.paper_tables.table_spec.PaperTable).
PRESETS = {
    "paper": {
        "run": dict(dataset="cifar100", model="cifar-cnn", clients=100, participation=0.1, sampling="bernoulli",
                    partition="dirichlet", rounds=500, local_epochs=5, batch_size=50, lr=0.1, lr_decay=0.998,
                    weight_decay=1e-3, clip=10.0, eval_every=5, checkpoint_every=10),
        "hessian": dict(top=1, method="power", tol=1e-3, trace=True, trace_method="pyhessian", trace_hvps=100,
                        samples=None, batch_size=50),
        "spectrum": dict(top=200, method="lanczos", tol=1e-3, trace=False, density=True, density_steps=100,
                         density_starts=4, samples=None, batch_size=256),
    },
    "quick": {  # the README's main job, sized for a laptop (docs/reproductions.md, the quick preset)
        "run": dict(dataset="digits", model="digits-cnn", clients=20, participation=0.5, sampling="bernoulli",
                    partition="dirichlet", rounds=30, local_epochs=2, batch_size=50, lr=0.1, lr_decay=0.998,
                    weight_decay=1e-3, clip=10.0, eval_every=5, checkpoint_every=10, precision=CPU_PRECISION,
                    track_hessian=10,  # the server model's curvature at rounds 10, 20 and 30
                    track_hessian_settings={"trace_method": "exact"},
                    parallel_clients="all"),  # a round's clients stacked: 1.2-1.4x faster here (docs/performance.md)
        # the trace computed, not estimated: the digits CNN is linear in each layer's parameters, so the Hessian's
        # trace is the Gauss-Newton matrix's, a sum of per-sample squared norms (docs/analysis.md, "The exact trace")
        "hessian": dict(top=1, method="lanczos", tol=1e-3, trace=True, trace_method="exact", samples=None,
                        batch_size=512),
        "spectrum": dict(top=50, method="lanczos", tol=1e-3, trace=False, density=True, density_steps=80,
                         density_starts=2, samples=None, batch_size=512),
        "spectrum_seeds": "first",  # the Fig. 4 spectrum of the first seed only: the preset's largest cost
    },
    "fmnist": _FMNIST,
    # the same protocol with the paper's CNN family at LeNet-5 widths: only the network differs (<= 60 min too)
    "fmnist-cnn": dict(_FMNIST, run=dict(_FMNIST["run"], model="cifar-cnn",
                                         model_args={"channels": [6, 16], "hidden": [120, 84]})),
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
