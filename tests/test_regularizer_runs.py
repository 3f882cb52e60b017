"""Every regularizer registered with its flags, and regularizers composed with algorithms and local optimizers,
trained through the engine on the digits (the unit checks of each regularizer: ``tests/test_regularizers.py``)."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from flatfl.errors import ConfigError
from flatfl.models.slimmable import SLIMMABLE_TYPES
from flatfl.train.catalog import all_hparams, load_all
from flatfl.train.components import ALGORITHMS, LOCAL_OPTIMIZERS, REGULARIZERS
from flatfl.train.config import RunConfig
from flatfl.train.engine import Trainer
from flatfl.train.regularizers.fedalign import FedAlign
from flatfl.train.regularizers.gradaug import GradAug
from flatfl.train.regularizers.man import MAN


def _slim_widths(model):
    return {m.width for m in model.modules() if isinstance(m, SLIMMABLE_TYPES)} | {model.width}


def make_reg(cls, num_classes=10, **settings):
    return cls(cls.resolve(settings), num_classes=num_classes)


def test_every_regularizer_and_flag_is_registered():
    load_all()
    assert {"none", "man", "asd", "fedalign", "gradaug", "mixup", "stochdepth"} <= set(REGULARIZERS)
    flags = all_hparams()
    for key in ("zeta", "asd_lambda", "asd_beta", "asd_beta_entropy", "temperature", "fedalign_mu", "width",
                "num_subnets", "gradaug_mu", "mixup_gamma", "survival_last"):
        assert key in flags, key
    assert MAN.resolve({"zeta": "0.3"})["zeta"] == 0.3
    with pytest.raises(ConfigError, match="zeta"):
        MAN.resolve({"zeta": -1})
    assert FedAlign.resolve({})["width"] == 0.25 and GradAug.resolve({})["width"] == 0.8  # shared flag, own default


# ------------------------------------------------------------------------------------------ composition runs
DIGITS_RUN = dict(dataset="digits", model="digits-cnn", clients=4, participation=1.0, partition="dirichlet",
                  alpha=1.0, rounds=2, local_epochs=2, batch_size=20, lr=0.1, momentum=0.9, eval_every=100,
                  checkpoint_every=100, seed=0)  # evaluated once, after the last round


def train_digits(tmp_path, **overrides) -> Trainer:
    settings = dict(DIGITS_RUN)
    settings.update(overrides)
    cfg = RunConfig(**settings).validate()
    trainer = Trainer(cfg, tmp_path / f"run-{cfg.algo}-{cfg.local_opt}-{cfg.reg}", quiet=True)
    trainer.run()
    return trainer


COMPOSITIONS = [("feddyn", "sgd", "man"), ("fedspeed", "sgd", "man"), ("fedsam", "sgd", "asd"),
                ("fedavg", "sgd", "fedalign"), ("fedprox", "asam", "man")]


@pytest.mark.parametrize("algo,local_opt,reg", COMPOSITIONS)
def test_composition_learns_on_digits(tmp_path, algo, local_opt, reg):
    load_all()
    if algo not in ALGORITHMS or local_opt not in LOCAL_OPTIMIZERS:
        pytest.skip(f"{algo} / {local_opt} not implemented yet")
    tr = train_digits(tmp_path, algo=algo, local_opt=local_opt, reg=reg)
    last = tr.metrics[-1]
    assert tr.resolved["regularizer"]["name"] == reg
    if algo == "fedsam":
        assert tr.resolved["local_opt"]["name"] == "sam"  # ASD enters both SAM passes
    assert last["test_acc"] > 0.6, last  # chance is 0.1
    assert last["train_loss"] < math.log(10) - 0.1, last  # below the loss of a uniform prediction


@pytest.mark.parametrize("reg", ["gradaug", "stochdepth", "mixup"])
def test_resnet_regularizers_run_through_the_engine(tmp_path, reg):
    tr = train_digits(tmp_path, model="resnet20", reg=reg, rounds=1, local_epochs=1, clients=2, batch_size=64)
    assert torch.isfinite(tr.theta).all() and math.isfinite(tr.metrics[-1]["train_loss"])
    assert _slim_widths(tr.model) == {1.0}  # evaluated and saved at full width
    survival = [b.survival for b in tr.model.residual_blocks()]
    assert survival[-1] == (0.9 if reg == "stochdepth" else 1.0)


def summed_activation_norm(trainer: Trainer) -> float:
    """sum_l mean(a_l^2) of the final server model over the whole training set (MAN's Reg without its weight)."""
    model = copy.deepcopy(trainer.model)
    trainer_layout = type(trainer.layout)(model)
    trainer_layout.set(trainer.theta)
    model.eval()
    probe = make_reg(MAN)
    probe.attach(model)
    with torch.no_grad():
        _, terms = probe.capture(model, trainer.ds.normalize(trainer.ds.train_x))
    return float(sum(terms))


def test_man_lowers_the_activation_norm_of_the_final_model(tmp_path):
    plain = train_digits(tmp_path, reg="none")
    man = train_digits(tmp_path, reg="man", params={"zeta": 1.0})
    assert man.theta.shape == plain.theta.shape and not torch.equal(man.theta, plain.theta)
    n_plain, n_man = summed_activation_norm(plain), summed_activation_norm(man)
    found = (f"summed activation norm of the final digits model: none {n_plain:.4f}, MAN(zeta=1) {n_man:.4f}; "
             f"test acc {plain.metrics[-1]['test_acc']:.3f} / {man.metrics[-1]['test_acc']:.3f}")
    assert n_man < 0.8 * n_plain, found
    assert man.metrics[-1]["test_acc"] > 0.6, found
