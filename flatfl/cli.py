"""The ``flatfl`` command line. Each command parses its options and calls one library function.

Errors caused by the user's input are :class:`flatfl.errors.FlatflError`; they are printed as one line
(``flatfl: error: ...``) with exit status 2, never as a traceback.
"""
from __future__ import annotations

import functools
import sys

import click

from .errors import FlatflError


def friendly_errors(fn):
    """Turn FlatflError (and a few well-known OS errors) into one line on stderr and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FlatflError as e:
            click.echo(f"flatfl: error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("flatfl: interrupted", err=True)
            sys.exit(130)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="flatfl")
def main() -> None:
    """flatfl: federated learning with flatness regularizers, and the curvature of what it learns."""


# --------------------------------------------------------------------------------------------------------- train
def _hparam_options(fn):
    """Add one click option per hyper-parameter flag declared by any algorithm, optimizer or regularizer."""
    from .train.components import all_hparams

    for key, hp in sorted(all_hparams().items(), reverse=True):
        t = hp.py_type
        ctype = click.Choice(list(hp.choices)) if hp.choices else {bool: click.BOOL, int: int, float: float}.get(t, str)
        fn = click.option(hp.cli_flag, key, type=ctype, default=None, show_default=False,
                          help=f"{hp.help} (default {hp.default!r}; see 'flatfl algos')")(fn)
    return fn


TRAIN_EPILOG = """\b
Examples:
  flatfl train                                     # FedAvg on the embedded digits, 20 clients, Dirichlet 0.3
  flatfl train --algo feddyn --reg man --zeta 0.15 --rounds 100 --out runs/dyn-man
  flatfl train --dataset cifar100 --data-dir ~/data --clients 100 --participation 0.1 \\
               --rounds 500 --local-epochs 5 --device cuda --config paper.toml
  flatfl train --resume runs/dyn-man               # continue a killed run
"""


@main.command(epilog=TRAIN_EPILOG)
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML or YAML file of settings; command-line values win.")
@click.option("--dataset", help="digits (embedded, default) | cifar10 | cifar100 | tinyimagenet | emnist")
@click.option("--data-dir", help="folder holding the dataset files (default ./data)")
@click.option("--model", help="model name (default: the dataset's; see 'flatfl models')")
@click.option("--augment/--no-augment", default=None, help="flip + padded-crop augmentation (default: on for CIFAR/Tiny-ImageNet)")
@click.option("--partition", type=click.Choice(["dirichlet", "fedml-dirichlet", "iid"]), help="client split (default dirichlet)")
@click.option("--alpha", type=float, help="Dirichlet concentration (default 0.3)")
@click.option("--clients", type=int, help="number of clients N (default 20)")
@click.option("--participation", type=float, help="fraction / probability of clients per round, in (0, 1] (default 0.5)")
@click.option("--sampling", type=click.Choice(["bernoulli", "fraction"]), help="bernoulli: each client joins with prob p (FedDyn code, default); fraction: a fixed round(pN)")
@click.option("--rounds", type=int, help="communication rounds (default 50)")
@click.option("--local-epochs", type=int, help="local epochs E (default 2)")
@click.option("--batch-size", type=int, help="local batch size B (default 50)")
@click.option("--lr", type=float, help="local learning rate eta0 (default 0.1)")
@click.option("--lr-decay", type=float, help="per-round learning-rate factor (default 0.998)")
@click.option("--weight-decay", type=float, help="SGD weight decay (default 1e-3)")
@click.option("--momentum", type=float, help="local SGD momentum (default 0)")
@click.option("--nesterov/--no-nesterov", default=None, help="Nesterov momentum (default off)")
@click.option("--clip", type=float, help="global gradient-norm clip, 0 = off (default 10)")
@click.option("--algo", help="FL algorithm (default fedavg; see 'flatfl algos')")
@click.option("--local-opt", help="local optimizer: sgd | sam | asam ... (default sgd)")
@click.option("--reg", help="local regularizer: none | man | asd | fedalign | ... (default none)")
@click.option("--seed", type=int, help="seed of every random choice (default 0)")
@click.option("--device", help="cpu | cuda | cuda:N | mps (default cpu)")
@click.option("--eval-every", type=int, help="evaluate every k rounds (default 1)")
@click.option("--checkpoint-every", type=int, help="write a checkpoint every k rounds (default 10)")
@click.option("--save-clients/--no-save-clients", default=None, help="also write each client's latest local model (clients.pt)")
@click.option("--out", type=click.Path(file_okay=False), help="run directory (default runs/<dataset>-<algo>-<reg>-<partition>-s<seed>)")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False), help="continue the run in this directory")
@click.option("--force", is_flag=True, help="overwrite an existing run directory")
@click.option("--quiet", is_flag=True, help="no progress output")
@_hparam_options
@friendly_errors
def train(config_file, resume_dir, force, quiet, **opts):
    """Simulate federated training and write a run directory (config, partition, metrics.csv, checkpoints)."""
    from .train.run import train_from_options

    final = train_from_options(config_file=config_file, resume_dir=resume_dir, force=force, quiet=quiet, opts=opts)
    click.echo(str(final))


@main.command()
@click.option("--dataset", default="digits", show_default=True)
@click.option("--data-dir", default="data", show_default=True)
@click.option("--partition", "method", type=click.Choice(["dirichlet", "fedml-dirichlet", "iid"]), default="dirichlet", show_default=True)
@click.option("--alpha", type=float, default=0.3, show_default=True)
@click.option("--clients", type=int, default=20, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--run", "run_dir", type=click.Path(file_okay=False), help="print the partition saved in this run instead")
@friendly_errors
def partition(dataset, data_dir, method, alpha, clients, seed, run_dir):
    """Print the per-client label histogram of a partition (or of a run's saved partition)."""
    from .train.run import describe_partition

    click.echo(describe_partition(dataset, data_dir, method, alpha, clients, seed, run_dir))


@main.command()
@friendly_errors
def algos():
    """List algorithms, local optimizers and regularizers with their hyper-parameters and defaults."""
    from .train.components import ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS, describe, load_all

    load_all()
    for title, reg in (("Algorithms (--algo)", ALGORITHMS), ("Local optimizers (--local-opt)", LOCAL_OPTIMIZERS),
                       ("Regularizers (--reg)", REGULARIZERS)):
        click.echo(f"{title}\n" + describe(reg) + "\n")


@main.command()
@friendly_errors
def models():
    """List the model names."""
    from .models import model_names

    click.echo("\n".join(model_names()))
