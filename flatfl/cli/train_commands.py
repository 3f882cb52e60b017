"""``flatfl train``, ``partition``, ``algos`` and ``models``: training and what it is made of. The help of
``train`` states the defaults :class:`~flatfl.train.config.RunConfig` owns, read from its fields."""
from __future__ import annotations

from pathlib import Path

import click

from ..train.config import RunConfig
from ..analysis.commands.hessian_settings import tracking_settings
from ..utils.precision import PRECISIONS
from .common import NameChoice, friendly_errors, threads_option

__all__ = ["train", "partition", "algos", "models", "TrainCommand", "hparam_click_options"]

TRACKING = tracking_settings()  # the defaults of flatfl train --track-hessian
RUN_DEFAULTS = RunConfig()


def default(name: str) -> str:
    """RunConfig's default of field ``name`` as the help shows it: numbers short (1e-3, 0.5, 10), booleans on/off."""
    value = getattr(RUN_DEFAULTS, name)
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:.0e}".replace("e-0", "e-") if 0 < abs(value) < 0.01 else f"{value:g}"
    return str(value)


def hparam_click_options() -> list[click.Option]:
    """One click option per hyper-parameter flag declared by any algorithm, optimizer or regularizer, by name."""
    from ..train.catalog import all_hparams

    options = []
    for key, hp in sorted(all_hparams().items()):
        t = hp.py_type
        ctype = NameChoice(hp.choices, kind=key.replace("_", " ")) if hp.choices else {bool: click.BOOL, int: int, float: float}.get(t, str)
        options.append(click.Option([hp.cli_flag, key], type=ctype, default=None, show_default=False,
                                    help=_hparam_help(key)))
    return options


class TrainCommand(click.Command):
    """``flatfl train``: the hyper-parameter options are added when the command is parsed or its help shown, so
    that the other commands (``flatfl hessian``...) never import the training registries."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if not getattr(self, "hparams_added", False):
            self.hparams_added = True
            self.params.extend(hparam_click_options())
        return super().get_params(ctx)


def _hparam_help(key: str) -> str:
    """The flag's help: what it is, which pieces read it and the default each applies (a flag shared by several
    pieces gets the first one's description without its trailing note, then every piece's own default)."""
    import re

    from ..train.catalog import KIND_FLAGS, hparam_declarations
    from ..train.components import ALGORITHMS

    decl = hparam_declarations()[key]
    if len(decl) == 1:
        kind, name, hp = decl[0]
        return f"{hp.help} [{KIND_FLAGS[kind]} {name} only; default {hp.default!r}]"
    text = re.sub(r"\s*\([^()]*\)$", "", decl[0][2].help)
    parts = []
    for kind, name, hp in decl:
        also = [a for a, cls in sorted(ALGORITHMS.items()) if kind == "local optimizer" and cls.local_opt == name
                and key not in {h.key for h in cls.hparams}]
        parts.append(f"{KIND_FLAGS[kind]} {name}" + (f" (and --algo {', '.join(also)})" if also else "")
                     + f": {hp.default!r}")
    return f"{text} [default by piece: {'; '.join(parts)}]"


TRAIN_EPILOG = """\b
Examples:
  flatfl train                                     # FedAvg on the embedded digits, 20 clients, Dirichlet 0.3
  flatfl train --algo feddyn --reg man --zeta 0.15 --rounds 100 --out runs/dyn-man
  flatfl train --dataset cifar100 --data-dir ~/data --clients 100 --participation 0.1 \\
               --rounds 500 --local-epochs 5 --device cuda --config paper.toml
  flatfl train --resume runs/dyn-man               # continue a killed run
"""


@click.command(cls=TrainCommand, epilog=TRAIN_EPILOG)
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML or YAML file of settings; command-line values win.")
@click.option("--dataset", help=f"{default('dataset')} (embedded, default) | cifar10 | cifar100 | tinyimagenet | emnist | fashion-mnist")
@click.option("--data-dir", help=f"folder holding the dataset files (default ./{default('data_dir')}; Fashion-MNIST: then Debian's "
              "/usr/share/datasets/fashion-mnist)")
@click.option("--download/--no-download", default=None, help="fetch missing dataset files (default: yes, except "
              "Fashion-MNIST, whose usual source is 'apt-get install dataset-fashion-mnist')")
@click.option("--model", help="model name (default: the dataset's; see 'flatfl models')")
@click.option("--augment/--no-augment", default=None, help="flip + padded-crop augmentation (default: on for CIFAR/Tiny-ImageNet)")
@click.option("--partition", type=NameChoice(["dirichlet", "fedml-dirichlet", "iid"], kind="partition"), help=f"client split (default {default('partition')})")
@click.option("--alpha", type=float, help=f"Dirichlet concentration (default {default('alpha')})")
@click.option("--clients", type=int, help=f"number of clients N (default {default('clients')})")
@click.option("--participation", type=float, help=f"fraction / probability of clients per round, in (0, 1] (default {default('participation')})")
@click.option("--sampling", type=NameChoice(["bernoulli", "fraction"], kind="sampling"), help="bernoulli: each client joins with prob p (FedDyn code, default); fraction: a fixed round(pN)")
@click.option("--rounds", type=int, help=f"communication rounds (default {default('rounds')})")
@click.option("--local-epochs", type=int, help=f"local epochs E (default {default('local_epochs')})")
@click.option("--batch-size", type=int, help=f"local batch size B (default {default('batch_size')})")
@click.option("--lr", type=float, help=f"local learning rate eta0 (default {default('lr')})")
@click.option("--lr-decay", type=float, help=f"per-round learning-rate factor (default {default('lr_decay')})")
@click.option("--weight-decay", type=float, help=f"SGD weight decay (default {default('weight_decay')})")
@click.option("--momentum", type=float, help=f"local SGD momentum (default {default('momentum')})")
@click.option("--nesterov/--no-nesterov", default=None, help=f"Nesterov momentum (default {default('nesterov')})")
@click.option("--clip", type=float, help=f"global gradient-norm clip, 0 = off (default {default('clip')})")
@click.option("--algo", help=f"FL algorithm (default {default('algo')}; see 'flatfl algos')")
@click.option("--local-opt", help=f"local optimizer: sgd | sam | asam ... (default {default('local_opt')})")
@click.option("--reg", help=f"local regularizer: none | man | asd | fedalign | ... (default {default('reg')})")
@click.option("--seed", type=int, help=f"seed of every random choice (default {default('seed')})")
@click.option("--device", help=f"cpu | cuda | cuda:N | mps (default {default('device')})")
@click.option("--parallel-clients", help="train up to N of a round's participants at once as one batched computation, "
              "N an integer or 'all' (default: all on CUDA, 1 on CPU; the same numbers up to float rounding)")
@click.option("--precision", type=NameChoice(PRECISIONS, kind="precision"), help="floating type of the model, data, "
              f"algorithm state and every product: float32 | float64 (default {default('precision')}; float64 gives "
              "the same numbers on any CPU to about 1e-12 and is slow on a GPU); recorded in config.json")
@click.option("--float32-matmul", type=NameChoice(["full", "tf32"], kind="float32 mode"), help="float32 matrix "
              f"products and convolutions on CUDA: full (IEEE float32{', the default' if RUN_DEFAULTS.float32_matmul == 'full' else ''}) or tf32 (TensorFloat-32: faster, "
              "about 1e-3 relative per product); recorded in config.json")
@click.option("--cuda-graphs/--no-cuda-graphs", default=None, help="CUDA: capture a cohort's local step once a round "
              "as a CUDA graph and replay it (one launch a step); steps that cannot be replayed exactly run eagerly, "
              f"with a one-line notice (default {default('cuda_graphs')})")
@click.option("--eval-every", type=int, help=f"evaluate every k rounds (default {default('eval_every')})")
@click.option("--checkpoint-every", type=int, help=f"write a checkpoint every k rounds (default {default('checkpoint_every')})")
@click.option("--save-clients/--no-save-clients", default=None, help="also write each client's latest local model (clients.pt)")
@click.option("--out", type=click.Path(file_okay=False), help="run directory (default runs/<dataset>-<algo>-<reg>-<partition>-s<seed>)")
@click.option("--track-hessian", type=int, help="every K rounds and at the end, the server model's top Hessian "
              "eigenvalue, trace (with standard error) and loss on a fixed evaluation set, as columns of metrics.csv "
              "(the numbers 'flatfl hessian' gives with the same settings; 0 = off, the default)")
@click.option("--track-top", type=int, help="with --track-hessian: how many top eigenvalues (default "
              f"{TRACKING.top}; 0 = trace only)")
@click.option("--track-samples", type=int, help="with --track-hessian: size of the fixed evaluation sample of the "
              f"training split (default {TRACKING.samples})")
@click.option("--track-curvature", help="with --track-hessian: the matrix tracked, hessian | ggn | empirical-fisher "
              f"(default {TRACKING.curvature}; recorded in config.json's tracking)")
@click.option("--track-measure", metavar="NAME[,NAME...]", help="with --track-hessian: also these measured "
              "quantities (flatfl hessian --measure; e.g. frobenius), each a column of metrics.csv with its standard "
              "error")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False), help="continue the run in this directory")
@click.option("--force", is_flag=True, help="overwrite an existing run directory")
@click.option("--quiet", is_flag=True, help="no progress output")
@threads_option
@friendly_errors
def train(config_file, resume_dir, force, quiet, **opts):
    """Simulate federated training and write a run directory (config, partition, metrics.csv, checkpoints)."""
    from ..analysis.commands.tracking import curvature_observer
    from ..train.train_command import train_from_options

    tracking = {k: v for k, v in (("top", opts.pop("track_top")), ("samples", opts.pop("track_samples")),
                                  ("curvature", opts.pop("track_curvature")),
                                  ("measure", opts.pop("track_measure"))) if v is not None}
    if tracking:
        opts["track_hessian_settings"] = tracking
    final = train_from_options(config_file=config_file, resume_dir=resume_dir, force=force, quiet=quiet, opts=opts,
                               observer_for=curvature_observer)
    click.echo(_train_summary(final))


def _train_summary(final) -> str:
    """One line: the last evaluated round's test accuracy (server model, all-clients average) and the checkpoint."""
    import csv

    rows = []
    metrics = Path(final).parent / "metrics.csv"
    if metrics.is_file():
        with open(metrics, newline="") as f:
            rows = list(csv.DictReader(f))
    if not rows:
        return f"trained -> {final}"
    last = rows[-1]
    return (f"round {last['round']}: test accuracy {100 * float(last['test_acc']):.2f}% (server model), "
            f"{100 * float(last['all_test_acc']):.2f}% (average of all clients' models) -> {final}")


@click.command()
@click.option("--dataset", default="digits", show_default=True)
@click.option("--data-dir", default="data", show_default=True)
@click.option("--partition", "method", type=NameChoice(["dirichlet", "fedml-dirichlet", "iid"], kind="partition"), default="dirichlet", show_default=True)
@click.option("--alpha", type=float, default=0.3, show_default=True)
@click.option("--clients", type=int, default=20, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--run", "run_dir", type=click.Path(file_okay=False), help="print the partition saved in this run instead")
@friendly_errors
def partition(dataset, data_dir, method, alpha, clients, seed, run_dir):
    """Print the per-client label histogram of a partition (or of a run's saved partition)."""
    from ..train.train_command import describe_partition

    click.echo(describe_partition(dataset, data_dir, method, alpha, clients, seed, run_dir))


@click.command()
@friendly_errors
def algos():
    """List algorithms, local optimizers and regularizers with their hyper-parameters and defaults."""
    from ..train.catalog import describe, load_all
    from ..train.components import ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS

    load_all()
    for title, reg in (("Algorithms (--algo)", ALGORITHMS), ("Local optimizers (--local-opt)", LOCAL_OPTIMIZERS),
                       ("Regularizers (--reg)", REGULARIZERS)):
        click.echo(f"{title}\n" + describe(reg) + "\n")


@click.command()
@friendly_errors
def models():
    """List the model names."""
    from ..models import model_names

    click.echo("\n".join(model_names()))
