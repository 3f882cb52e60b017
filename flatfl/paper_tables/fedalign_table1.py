"""FedAlign Table 1: FedAvg, FedProx, MOON, and FedAvg with Mixup, StochDepth, GradAug and FedAlign on the FedML
Dirichlet 0.5 split, with cross-client H_N / H_D."""
from __future__ import annotations

from .man_common import CPU_PRECISION
from .table_spec import Method, PaperTable, TableSpec

SPEC = TableSpec(
    key="fedalign-table1", source="FedAlign", table="Table 1",
    title="FedAlign Table 1: accuracy, top eigenvalue, trace H_T and cross-client H_N, H_D",
    rows=("FedAvg", "FedProx", "MOON", "FedAvg+Mixup", "FedAvg+StochDepth", "FedAvg+GradAug",
          "FedAvg+FedAlign"),
    partitions=("fedml-dirichlet-0.5",),
    metrics=("accuracy", "top_eigenvalue", "trace", "hessian_norm_gap", "hessian_direction"),
    comparisons=(("FedAvg", "FedProx"), ("FedAvg", "MOON"), ("FedAvg", "FedAvg+Mixup"),
                 ("FedAvg", "FedAvg+StochDepth"), ("FedAvg", "FedAvg+GradAug"), ("FedAvg", "FedAvg+FedAlign")),
    paper_scale=("paper: CIFAR-100, ResNet-56, 16 clients all participating, Dirichlet 0.5 (FedML), 25 rounds x "
                 "20 local epochs, PyHessian power iteration and Hutchinson"),
    default_model="server",
    paper_names=(("FedAvg+Mixup", "Mixup"), ("FedAvg+StochDepth", "StochDepth"), ("FedAvg+GradAug", "GradAug")),
    notes=("FedAlign itself has no row in the paper's Table 1 (its accuracy is in Table 2 there); ours is shown "
           "without a paper value.",
           "H_N and H_D: cross-client Hessian diagonals (flatfl.analysis.estimators.client_metrics); the protocol used is in the "
           "subtitle, each run's in runs.csv (clients_protocol)."))

#: what every preset's runs share: FedAlign's training recipe (all clients every round, the FedML Dirichlet 0.5
#: split, SGD with Nesterov momentum, no learning-rate decay) and the files its analyses need
FEDML_TRAINING = dict(participation=1.0, sampling="fraction", partition="fedml-dirichlet", alpha=0.5, batch_size=64,
                      lr=0.01, lr_decay=1.0, momentum=0.9, nesterov=True, weight_decay=1e-4, clip=0.0, eval_every=1,
                      save_clients=True)

PRESETS = {
    "paper": {
        "run": dict(FEDML_TRAINING, dataset="cifar100", model="resnet56", clients=16, rounds=25, local_epochs=20,
                    checkpoint_every=1),
        "hessian": dict(top=1, method="power", tol=1e-3, trace=True, trace_method="pyhessian", trace_hvps=100,
                        samples=None, batch_size=64),
        "clients": dict(protocol="fedalign", probes=100, tol=1e-3),
        "surface": dict(directions="hessian", grid=21, range=1.0, samples=2560, batch_size=256),
    },
    "quick": {
        "run": dict(FEDML_TRAINING, dataset="digits", model="resnet20", clients=16, rounds=10, local_epochs=2,
                    checkpoint_every=5, precision=CPU_PRECISION),
        "hessian": dict(top=1, method="lanczos", tol=1e-3, trace=True, trace_method="hutchpp", trace_hvps=40,
                        trace_rtol=0.02, samples=512, batch_size=256),
        "clients": dict(protocol="default", probes=20, groups=5, samples=64),
        "surface": dict(directions="hessian", grid=9, range=1.0, samples=256, batch_size=256),
    },
    "tiny": {
        "run": dict(FEDML_TRAINING, dataset="digits", model="resnet20", clients=4, rounds=1, local_epochs=1,
                    checkpoint_every=1),
        "hessian": dict(top=1, method="lanczos", tol=1e-2, trace=True, trace_method="hutchpp", trace_hvps=6,
                        trace_rtol=None, samples=32, batch_size=32),
        "clients": dict(protocol="default", probes=4, groups=2, samples=16),
        "surface": dict(directions="random", grid=3, range=0.5, samples=32, batch_size=32),
    },
}

TABLE = PaperTable(
    spec=SPEC, position=30, presets=PRESETS,
    methods=(
        Method("FedAvg", {"algo": "fedavg"}),
        Method("FedProx", {"algo": "fedprox", "mu": 1e-4}),
        Method("MOON", {"algo": "moon", "moon_mu": 1.0, "moon_tau": 0.5}),
        Method("FedAvg+Mixup", {"algo": "fedavg", "reg": "mixup", "mixup_gamma": 0.1}),
        Method("FedAvg+StochDepth", {"algo": "fedavg", "reg": "stochdepth", "survival_last": 0.9}),
        Method("FedAvg+GradAug", {"algo": "fedavg", "reg": "gradaug", "gradaug_mu": 1.75, "num_subnets": 2,
                                  "width": 0.8}),
        Method("FedAvg+FedAlign", {"algo": "fedavg", "reg": "fedalign", "fedalign_mu": 0.45, "width": 0.25,
                                   "clip": 10.0}),  # FedAlign's code clips its gradients at norm 10
    ),
    code_followed={"FedAlign table": "the FedAlign code (FedML): FedProx, MOON, Mixup, StochDepth, GradAug, FedAlign "
                                     "as there; H_N / H_D with its 'fedalign' protocol; no SCAFFOLD or FedDC in the "
                                     "table"},
)
