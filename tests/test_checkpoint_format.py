"""The checkpoint format (flatfl.checkpoint): checkpoints of format 1, written before the model spec held the whole
architecture, still load; format 2 stores the projection head and the blocks' survival; training refuses a network
its spec does not describe."""
from __future__ import annotations

import pytest
import torch

import flatfl
from flatfl.errors import CheckpointError
from flatfl.checkpoint import FORMAT_VERSION, read_checkpoint, save_checkpoint
from flatfl.models import ProjectionHeadModel, architecture_spec, build_model, model_from_spec, set_stochastic_depth
from flatfl.run_layout import model_checkpoint
from flatfl.utils.io import atomic_torch_save

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

DIGITS = {"num_classes": 10, "in_channels": 1, "image_size": 8}


def moon_stochdepth_network(seed: int = 0) -> torch.nn.Module:
    """What a run with --algo moon --moon-proj-dim 16 --reg stochdepth --survival-last 0.5 trained (resnet20)."""
    torch.manual_seed(seed)
    net = ProjectionHeadModel(build_model("resnet20", **DIGITS), 16)
    set_stochastic_depth(net.encoder, 0.5)
    with torch.no_grad():  # weights and BatchNorm statistics off their initial values (the last norm of each
        for p in net.parameters():  # residual branch starts at zero: the survival would not show)
            p.add_(0.1 * torch.randn_like(p))
        for buf in net.buffers():
            if buf.is_floating_point():
                buf.add_(torch.rand_like(buf))
    return net.eval()


def format1_payload(net: torch.nn.Module) -> dict:
    """A checkpoint as flatfl 0.1.0 wrote it before the layering (format 1), key for key: its model_spec is the
    registry entry only (MOON's head and stochastic depth were re-applied through the run's algorithm and
    regularizer)."""
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    config = {"dataset": "digits", "data_dir": "data", "model": "resnet20", "model_args": {}, "augment": None,
              "partition": "dirichlet", "alpha": 0.3, "clients": 2, "rounds": 1, "participation": 0.5,
              "sampling": "bernoulli", "local_epochs": 1, "batch_size": 50, "lr": 0.1, "lr_decay": 0.998,
              "weight_decay": 0.001, "momentum": 0.0, "nesterov": False, "clip": 10.0, "algo": "moon",
              "local_opt": "sgd", "reg": "stochdepth", "params": {"moon_proj_dim": 16, "survival_last": 0.5},
              "seed": 3, "device": "cpu", "eval_every": 1, "eval_batch_size": 500, "checkpoint_every": 10,
              "save_clients": False, "out": "runs/old", "threads": 1}
    return {
        "flatfl_version": "0.1.0",
        "model_spec": {"name": "resnet20", "kwargs": dict(DIGITS, norm="bn", gn_groups=2, stochastic_depth=0.5)},
        "state_dict": state,
        "all_state_dict": {k: v.clone() for k, v in state.items()},
        "dataset": {"name": "digits", "data_dir": "data", "num_classes": 10, "input_shape": [1, 8, 8],
                    "custom": False, "file": None},
        "partition": {"num_clients": 2, "client_indices": [[0, 1], [2, 3]]},
        "config": config,
        "resolved": {"algorithm": {"name": "moon", "mu": 1.0, "tau": 0.5, "proj_dim": 16},
                     "local_opt": {"name": "sgd"}, "regularizer": {"name": "stochdepth", "survival_last": 0.5}},
        "round": 1,
        "metrics": [{"round": 1, "test_acc": 0.1}],
        "rng": {"torch": torch.get_rng_state(), "seed": 3},
        "format": "flatfl-checkpoint",
        "format_version": 1,
    }


def outputs(model: torch.nn.Module) -> torch.Tensor:
    x = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.eval()(x)


def test_a_format1_moon_stochdepth_checkpoint_loads_as_the_trained_network(tmp_path):
    net = moon_stochdepth_network()
    path = tmp_path / "final.pt"
    atomic_torch_save(format1_payload(net), path)
    ckpt = flatfl.load_checkpoint(path)
    assert isinstance(ckpt.model, ProjectionHeadModel) and ckpt.model.proj_dim == 16
    assert [b.survival for b in ckpt.model.encoder.residual_blocks()] == \
        [b.survival for b in net.encoder.residual_blocks()]
    assert torch.equal(outputs(ckpt.model), outputs(net))
    # the user's own network (here a resnet20 without stochastic depth): the head and the survival are added
    own = flatfl.load_checkpoint(path, model=build_model("resnet20", **DIGITS))
    assert torch.equal(outputs(own.model), outputs(net))


def test_a_format1_checkpoint_without_survival_loads_without_stochastic_depth(tmp_path):
    torch.manual_seed(0)
    net = ProjectionHeadModel(build_model("resnet20", **DIGITS), 16).eval()
    payload = format1_payload(net)
    payload["model_spec"]["kwargs"]["stochastic_depth"] = 1.0
    payload["config"]["reg"] = "none"
    payload["config"]["params"] = {"moon_proj_dim": 16}
    payload["resolved"]["regularizer"] = {"name": "none"}
    atomic_torch_save(payload, tmp_path / "final.pt")
    ckpt = flatfl.load_checkpoint(tmp_path / "final.pt")
    assert all(b.survival == 1.0 for b in ckpt.model.encoder.residual_blocks())
    assert torch.equal(outputs(ckpt.model), outputs(net))


def test_the_clients_average_checkpoint_of_a_format1_run_gets_the_whole_spec(tmp_path):
    net = moon_stochdepth_network()
    atomic_torch_save(format1_payload(net), tmp_path / "final.pt")
    path = model_checkpoint(tmp_path, "clients-average")
    payload = read_checkpoint(path)
    assert payload["format_version"] == FORMAT_VERSION == 2
    assert payload["model_spec"]["projection_head"] == 16
    assert torch.equal(outputs(flatfl.load_checkpoint(path).model), outputs(net))


def test_format2_stores_the_architecture_and_rebuilds_it_from_models_alone(tmp_path):
    net = moon_stochdepth_network(seed=4)
    spec = architecture_spec(net)
    assert spec["projection_head"] == 16 and spec["survival"][-1] == 0.5 and len(spec["survival"]) == 9
    shapes = {k: v.shape for k, v in model_from_spec(spec).state_dict().items()}
    assert shapes == {k: v.shape for k, v in net.state_dict().items()}
    payload = {k: v for k, v in format1_payload(net).items() if k not in ("format", "format_version")}
    payload["model_spec"] = spec
    payload["config"] = dict(payload["config"], algo="fedavg", reg="none", params={})  # the spec alone tells
    payload.pop("resolved")
    save_checkpoint(tmp_path / "final.pt", payload)
    ckpt = flatfl.load_checkpoint(tmp_path / "final.pt")
    assert torch.equal(outputs(ckpt.model), outputs(net))


def test_a_spec_that_does_not_fit_its_weights_is_one_clear_error(tmp_path):
    net = moon_stochdepth_network()
    payload = format1_payload(net)
    payload["resolved"]["algorithm"]["proj_dim"] = 32
    atomic_torch_save(payload, tmp_path / "final.pt")
    with pytest.raises(CheckpointError, match="weights do not fit"):
        flatfl.load_checkpoint(tmp_path / "final.pt")
    payload = format1_payload(net)
    payload["model_spec"]["survival"] = [0.5] * 3
    payload["format_version"] = 2
    atomic_torch_save(payload, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="survival values"):
        flatfl.load_checkpoint(tmp_path / "bad.pt")


def test_training_refuses_a_network_change_its_spec_does_not_record(tmp_path, monkeypatch):
    from flatfl.train.config import RunConfig
    from flatfl.train.engine import Trainer
    from flatfl.train.regularizers.regularizer import NoRegularizer

    def grow(cls, model, hp):
        model.extra = torch.nn.Linear(2, 2)  # an architecture change no spec entry describes
        return model

    cfg = RunConfig(model="tiny", rounds=1, clients=2).validate()
    monkeypatch.setattr(NoRegularizer, "prepare_model", classmethod(grow))
    with pytest.raises(RuntimeError, match="beyond what its spec records"):
        Trainer(cfg, tmp_path / "run", quiet=True)


def _as_before_the_rename(resolved: dict) -> dict:
    """``resolved`` as flatfl wrote it while FedSpeed's lambda was stored as ``alpha``."""
    algo = dict(resolved["algorithm"])
    algo["alpha"] = algo.pop("lam")
    return dict(resolved, algorithm=algo)


def test_a_fedspeed_run_written_with_alpha_loads_and_resumes(tmp_path, crash_in_round):
    """FedSpeed's lambda was recorded as 'alpha' in the checkpoints' and config.json's resolved settings: such a
    checkpoint reads as 'lam' (one way), and such a run resumes to the uninterrupted run's weights."""
    import json

    from flatfl.train.config import RunConfig
    from flatfl.train.engine import Trainer

    cfg = RunConfig(model="tiny", algo="fedspeed", rounds=3, clients=2, participation=1.0, batch_size=100,
                    checkpoint_every=1, seed=0, params={"fedspeed_lambda": 0.02}).validate()
    ref = Trainer(cfg, tmp_path / "ref", quiet=True)
    ref.run()
    old = tmp_path / "old"
    with crash_in_round(2), pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(cfg, old, quiet=True).run()
    info = json.loads((old / "config.json").read_text())
    assert info["resolved"]["algorithm"] == {"name": "fedspeed", "lam": 0.02, "rho": 0.1}
    (old / "config.json").write_text(json.dumps(dict(info, resolved=_as_before_the_rename(info["resolved"]))))
    for ck in sorted((old / "checkpoints").glob("round_*.pt")):
        payload = torch.load(ck, weights_only=True)
        atomic_torch_save(dict(payload, resolved=_as_before_the_rename(payload["resolved"])), ck)
        assert torch.load(ck, weights_only=True)["resolved"]["algorithm"]["alpha"] == 0.02
        assert read_checkpoint(ck)["resolved"]["algorithm"] == {"name": "fedspeed", "lam": 0.02, "rho": 0.1}
    resumed = Trainer(cfg, old, resume=True, quiet=True)
    assert resumed.start_round == 2 and resumed.algo.lam == 0.02
    resumed.run()
    assert torch.equal(ref.theta, resumed.theta)
    assert read_checkpoint(old / "final.pt")["resolved"]["algorithm"] == {"name": "fedspeed", "lam": 0.02, "rho": 0.1}


def test_a_payload_shared_or_nested_beyond_the_bounds_is_refused_on_loading_and_quickly(tmp_path):
    """A list shared by reference at every level (2^40 values from a few KB) or nested 100 deep, or a list inside
    itself, is refused when the checkpoint is read (one line naming the file and the key), measured without
    expanding it; flatfl's own payloads, a 64-deep nesting and a list shared a few times pass."""
    import time

    from flatfl.utils.torch_files import MAX_PAYLOAD_DEPTH, check_nesting

    net = moon_stochdepth_network()
    payload = {k: v for k, v in format1_payload(net).items() if k not in ("format", "format_version")}
    save_checkpoint(tmp_path / "final.pt", payload)
    read_checkpoint(tmp_path / "final.pt")  # flatfl's own: passes
    bomb = [0]
    for _ in range(40):
        bomb = [bomb, bomb]
    deep = [0]
    for _ in range(100):
        deep = [deep]
    ok = [0]
    for _ in range(MAX_PAYLOAD_DEPTH - 2):  # the payload is level 1, its values level 2
        ok = [ok]
    shared = list(range(1000))
    check_nesting({"a": ok, "b": [shared] * 100, "w": torch.zeros(3)}, "x.pt")
    loop = [1]
    loop.append(loop)
    for key, value in (("config", dict(payload["config"], params={"x": bomb})), ("metrics", deep),
                       ("partition", loop)):
        # written as save_checkpoint would, without its digests (which would expand the bomb)
        atomic_torch_save(dict(payload, format="flatfl-checkpoint", format_version=FORMAT_VERSION, **{key: value}),
                          tmp_path / "bad.pt")
        start = time.monotonic()
        with pytest.raises(CheckpointError, match=f"bad.pt: {key} nested too deeply or too large: not flatfl's"):
            read_checkpoint(tmp_path / "bad.pt")
        assert time.monotonic() - start < 5, key


def test_a_plain_pickle_is_named_without_torchs_warning_or_advice(tmp_path, recwarn):
    """A raw pickle (not torch's zip file) given as a checkpoint: one CheckpointError line saying so, no warning
    printed, and no quote of torch's advice to load it with weights_only=False."""
    import pickle

    (tmp_path / "p.pt").write_bytes(pickle.dumps({"format": "flatfl-checkpoint"}, protocol=4))
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(tmp_path / "p.pt")
    assert "a plain pickle: flatfl loads weights only" in str(info.value)
    assert "weights_only" not in str(info.value) and "\n" not in str(info.value)
    assert not [w for w in recwarn.list if "pickle" in str(w.message)]
