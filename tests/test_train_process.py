"""``flatfl train`` sets the process up once: from the command to the first round the device is resolved and
torch's threads are set one time each (the Trainer takes the process the command line set up), and a resumed run's
``--threads`` is the count it trains with. The Trainer holds its round loop and the state the two share."""
from __future__ import annotations

import importlib
import sys

import pytest
import torch
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.errors import ConfigError
from flatfl.train.config import RunConfig
from flatfl.train.engine import Trainer
from flatfl.train.rounds import RoundLoop, RoundState
from flatfl.utils import device as device_module
from flatfl.utils import threads as threads_module

TINY = ["--dataset", "digits", "--model", "tiny", "--clients", "2", "--local-epochs", "1", "--batch-size", "64",
        "--quiet"]


@pytest.fixture
def calls(monkeypatch):
    """Every call of ``resolve_device`` and ``apply_threads`` (their arguments), wherever flatfl calls them from: the
    function is replaced in its module and in every flatfl module that imported it by name."""
    for loaded in ("flatfl.analysis.commands.tracking", "flatfl.train.train_command"):  # what ``flatfl train`` loads, loaded before
        importlib.import_module(loaded)  # the spies are set: a name they import is replaced, and restored after

    seen = {"resolve_device": [], "apply_threads": []}
    for module, name in ((device_module, "resolve_device"), (threads_module, "apply_threads")):
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen[_name].append(args)
            return _real(*args, **kwargs)

        for mod in [module] + [m for n, m in list(sys.modules.items()) if n.startswith("flatfl.") and m is not module]:
            if getattr(mod, name, None) is real:
                monkeypatch.setattr(mod, name, spy)
    before = torch.get_num_threads()
    yield seen
    torch.set_num_threads(before)


def _train(*flags: str):
    r = CliRunner().invoke(main, ["train", *flags], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r


def test_train_resolves_the_device_and_sets_threads_once(tmp_path, calls):
    _train(*TINY, "--rounds", "1", "--threads", "1", "--out", str(tmp_path / "run"))
    assert calls == {"resolve_device": [("cpu",)], "apply_threads": [(1,)]}
    assert torch.get_num_threads() == 1


def test_train_without_threads_sets_the_machines_default_once(tmp_path, calls):
    _train(*TINY, "--rounds", "1", "--out", str(tmp_path / "run"))
    assert calls == {"resolve_device": [("cpu",)], "apply_threads": [(None,)]}
    assert torch.get_num_threads() == threads_module.default_threads()


def test_resume_sets_up_once_and_its_threads_win(tmp_path, calls):
    """The run recorded --threads 1; --resume ... --threads 2 trains with 2 (the recorded count is not applied
    after it)."""
    run = tmp_path / "run"
    _train(*TINY, "--rounds", "2", "--checkpoint-every", "1", "--threads", "1", "--out", str(run))
    (run / "final.pt").unlink()  # killed after round 2's checkpoint: the resume writes final.pt again
    calls["resolve_device"].clear()
    calls["apply_threads"].clear()
    r = _train("--resume", str(run), "--threads", "2")
    assert calls == {"resolve_device": [("cpu",)], "apply_threads": [(2,)]}, r.output
    assert torch.get_num_threads() == 2 and (run / "final.pt").is_file()


def test_trainer_holds_its_round_loop_and_the_state_they_share(tmp_path, calls):
    """From Python, without a thread count in the config, the Trainer resolves the device once and leaves torch's
    threads as they are."""
    torch.set_num_threads(1)
    cfg = RunConfig(dataset="digits", model="tiny", rounds=1, clients=2, local_epochs=1, batch_size=64).validate()
    tr = Trainer(cfg, tmp_path / "run", quiet=True)
    assert calls == {"resolve_device": [("cpu",)], "apply_threads": []} and torch.get_num_threads() == 1
    assert not issubclass(Trainer, RoundLoop) and isinstance(tr.loop, RoundLoop)
    assert isinstance(tr.state, RoundState) and tr.loop.state is tr.state
    start = tr.theta.clone()
    done = tr.run_round(0)
    assert tr.theta is tr.state.theta and not torch.equal(tr.theta, start)
    assert done.row is not None and done.row["round"] == 1 and done.path_changed is False


def test_a_process_that_is_not_a_setup_is_one_line(tmp_path):
    cfg = RunConfig(dataset="digits", model="tiny", rounds=1, clients=2).validate()
    with pytest.raises(ConfigError, match="start_process returns, not str"):
        Trainer(cfg, tmp_path / "run", quiet=True, process="cpu")
