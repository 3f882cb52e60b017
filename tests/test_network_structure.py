"""The record of a network of the user's (:mod:`flatfl.models.structure`), against networks written here: what
another network is (modules, settings, attributes passed in by the factory, non-persistent buffers), and what code
the network runs (its classes, their bases, the helpers and constants their source uses, the factory).

Each case writes a module of its own into a fresh folder, trains nothing, and compares the record taken from the
network the first version builds with the network an edited version builds, as the callers do when a run is
resumed or analysed: one phrase naming the difference, or the names whose code changed."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from flatfl.models.structure import code_changes, network_structure, structure_difference

BASE = '''
import functools
import torch
from torch import nn
import {helpers}

SCALE = 2.0
WIDTH = 8


def helper(x):
    return x * SCALE


class Base(nn.Module):
    def squash(self, x):
        return torch.tanh(x)


class Net(Base):
    def __init__(self, act=torch.relu, k=3, table=(1, 2)):
        super().__init__()
        self.a, self.b = nn.Linear(16, WIDTH), nn.Linear(WIDTH, 4)
        self.act, self.k, self.table = act, k, table
        self.register_buffer("proj", torch.randn(WIDTH, WIDTH), persistent=False)
        self.register_buffer("temperature", torch.tensor(1.5))

    def forward(self, x):
        h = self.squash(helper(self.act(self.a(x)) @ self.proj))
        return {helpers}.shift(self.b(h)) / self.temperature


def net():
    return Net(act=torch.relu)
'''
HELPERS = "def shift(x):\n    return x + 1\n"


@pytest.fixture
def package(tmp_path, monkeypatch):
    """write(source, helpers) -> the module written and imported afresh, as a new process sees it."""
    import linecache

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # an edit within one second is read again

    def write(source: str = BASE, helpers: str = HELPERS):
        (tmp_path / "helpers_s50.py").write_text(helpers)
        (tmp_path / "net_s50.py").write_text(source.replace("{helpers}", "helpers_s50"))
        importlib.invalidate_caches()
        linecache.clearcache()
        for n in ("net_s50", "helpers_s50"):
            sys.modules.pop(n, None)
        return importlib.import_module("net_s50")

    yield write
    for n in ("net_s50", "helpers_s50"):
        sys.modules.pop(n, None)


def record(module, factory=True) -> dict:
    torch.manual_seed(0)
    return json.loads(json.dumps(network_structure(module.net(), module.net if factory else None)))


def rebuilt(module):
    torch.manual_seed(0)
    return module.net()


def renamed(changes: list[str]) -> list[str]:
    """Code names without their module's name."""
    return sorted(c.split(".", 1)[1] for c in changes)


def test_the_record_names_what_the_network_holds_and_runs(package):
    m = package()
    rec = record(m)
    assert [e[:2] for e in rec["modules"]] == [["", f"{m.__name__}.Net"], ["a", "torch.Linear"], ["b", "torch.Linear"]]
    values = rec["values"]
    assert values["act"] == "torch.relu" and values["k"] == "3" and values["table"] == "(1, 2)"
    assert values["proj"].startswith("non-persistent buffer tensor float32[8, 8] sha256 ")
    assert "temperature" not in values  # a persistent buffer: the checkpoint holds it
    code = {k.split(".", 1)[1] for k in rec["code"]}
    # the class, its base, the helper it calls, the helper module's function, the constants they read, the factory
    assert code == {"Net", "Base", "helper", "SCALE", "WIDTH", "net", "shift"}, code
    assert all(isinstance(d, str) and len(d) == 64 for d in rec["code"].values())
    # the same network built again: the same record (its random non-persistent buffer drawn from the same seed)
    assert structure_difference(rec, rebuilt(m)) is None and code_changes(rec, rebuilt(m), m.net) == []


@pytest.mark.parametrize("edit, phrase", [
    (("act=torch.relu)", "act=torch.sigmoid)"), "attribute 'act' of the network is torch.sigmoid, trained as torch.relu"),
    (("k=3, table", "k=4, table"), "attribute 'k' of the network is 4, trained as 3"),
    (("table=(1, 2)", "table=(1, 3)"), "attribute 'table' of the network is (1, 3), trained as (1, 2)"),
    (("torch.randn(WIDTH, WIDTH)", "2 * torch.randn(WIDTH, WIDTH)"), "non-persistent buffer 'proj' of the network"),
    (("        self.act, self.k, self.table = act, k, table\n", "        self.act, self.table = act, table\n        self.kk = k\n"),
     "attribute 'k' of the network"),
    (("nn.Linear(WIDTH, 4)", "nn.Linear(WIDTH, 4, bias=False)"), "module 'b' is Linear(in_features=8, out_features=4, bias=False)"),
])
def test_another_network_is_named(package, edit, phrase):
    rec = record(package())
    edited = package(BASE.replace(*edit))
    differs = structure_difference(rec, rebuilt(edited))
    assert differs is not None and phrase in differs, differs


@pytest.mark.parametrize("edit, changed", [
    (("return x * SCALE", "return x * SCALE * 1"), ["helper"]),  # a helper called in forward
    (("SCALE = 2.0", "SCALE = 3.0"), ["SCALE"]),  # a constant it reads
    (("return torch.tanh(x)", "return torch.sigmoid(x)"), ["Base"]),  # a base class's method
    (("    return Net(act=torch.relu)", "    m = Net(act=torch.relu)\n    return m"), ["net"]),  # the factory
])
def test_changed_code_the_network_runs_is_named(package, edit, changed):
    rec = record(package())
    edited = package(BASE.replace(*edit))
    assert structure_difference(rec, rebuilt(edited)) is None
    assert renamed(code_changes(rec, rebuilt(edited), edited.net)) == changed


def test_a_helper_in_another_module_of_the_users_and_comments(package):
    rec = record(package())
    edited = package(BASE, "def shift(x):\n    return x + 2\n")
    assert renamed(code_changes(rec, rebuilt(edited), edited.net)) == ["shift"]
    commented = package(BASE.replace("def helper(x):", "# a comment\ndef helper(x):\n    '''a docstring'''"),
                        "# nothing but a comment\n" + HELPERS)
    assert code_changes(rec, rebuilt(commented), commented.net) == []


def test_values_of_other_kinds_are_recorded_by_what_they_are(package):
    m = package()

    def own(x):
        return x

    @dataclasses.dataclass
    class Settings:
        hidden: int = 8
        act: str = "relu"

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.fn = functools.partial(torch.clamp, min=0.0)
            self.own = own
            self.dtype = torch.float64
            self.mask = torch.ones(3)
            self.layers = [nn.Linear(2, 2)]  # a plain list: not registered
            self.options = {"p": 0.1, "mode": "fast"}
            self.none = None
            self.settings = Settings(act="gelu")

    values = network_structure(Holder())["values"]
    assert values["fn"] == "partial(torch.clamp, min=0.0)"
    assert values["own"].startswith(f"{__name__}.test_values_of_other_kinds_are_recorded_by_what_they_are.<locals>.own")
    assert values["dtype"] == "torch.float64" and values["none"] == "None"
    assert values["mask"].startswith("tensor float32[3] sha256 ")
    assert values["layers"] == "list(0: a torch.nn.modules.linear.Linear)"
    assert values["options"] == "dict('p': 0.1, 'mode': 'fast')"
    assert values["settings"].endswith(".Settings(act='gelu', hidden=8)")
    assert m is not None


def test_records_of_older_flatfl_compare_what_they_hold(package):
    """A record without ``values`` (older flatfl) compares the modules only; code names it lacks are not compared."""
    m = package()
    rec = record(m)
    old = {"modules": rec["modules"], "code": {k: v for k, v in rec["code"].items() if k.endswith(".Net")}}
    edited = package(BASE.replace("act=torch.relu)", "act=torch.sigmoid)").replace("x * SCALE", "x * SCALE * 1"))
    assert structure_difference(old, rebuilt(edited)) is None
    assert code_changes(old, rebuilt(edited), edited.net) == []


def test_analysis_and_resume_refuse_another_network_and_name_changed_helpers(tmp_path, monkeypatch):
    """Through the commands: a run trained with a factory; an argument the factory passes (an activation), a
    non-persistent buffer, a helper called in forward edited afterwards. ``flatfl hessian`` and ``--resume``
    refuse the first two in one line; the helper is a notice; the unedited factory, whose random non-persistent
    buffer is drawn again from the run's seed, passes silently."""
    from flatfl.cli import main
    from flatfl.train.config import RunConfig
    from flatfl.train.engine import Trainer
    from flatfl.train.identity import experiment_settings, network_identity

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    source = textwrap.dedent('''
        import torch
        from torch import nn


        def helper(x):
            return x * 2


        class Net(nn.Module):
            def __init__(self, act):
                super().__init__()
                self.a, self.b = nn.Linear(64, 8), nn.Linear(8, 10)
                self.act = act
                self.register_buffer("proj", torch.randn(8, 8), persistent=False)

            def forward(self, x):
                return self.b(helper(self.act(self.a(x.flatten(1)))) @ self.proj)


        def net():
            return Net(torch.relu)
        ''')
    (tmp_path / "fac_s50.py").write_text(source)
    cfg = RunConfig(rounds=1, clients=2, batch_size=64, threads=1).validate()
    final = Trainer(cfg, tmp_path / "run", model_factory="fac_s50:net", quiet=True).run()
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["model"]

    def hessian(out):
        sys.modules.pop("fac_s50", None)
        importlib.invalidate_caches()
        return CliRunner().invoke(main, ["hessian", str(final), "--top", "1", "--no-trace", "--samples", "16",
                                         "--quiet", "--out", str(tmp_path / out)])

    r = hessian("h-same")
    assert r.exit_code == 0 and "notice" not in r.stderr, r.output

    (tmp_path / "fac_s50.py").write_text(source.replace("Net(torch.relu)", "Net(torch.tanh)"))
    r = hessian("h-act")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "attribute 'act' of the network is torch.tanh, trained as torch.relu" in lines[0]
    assert not (tmp_path / "h-act").exists()
    sys.modules.pop("fac_s50", None)
    r = CliRunner().invoke(main, ["train", "--resume", str(tmp_path / "run"), "--quiet"])
    assert r.exit_code == 2 and "your network is not the one the run trained (attribute 'act'" in r.stderr, r.output

    (tmp_path / "fac_s50.py").write_text(source.replace("torch.randn(8, 8)", "torch.rand(8, 8)"))
    r = hessian("h-buffer")
    assert r.exit_code == 2 and "non-persistent buffer 'proj' of the network" in r.stderr, r.output

    (tmp_path / "fac_s50.py").write_text(source.replace("return x * 2", "return x * 3"))
    r = hessian("h-helper")
    assert r.exit_code == 0 and "notice: the code of fac_s50.helper changed since" in r.stderr, r.output

    # a run of the edited helper is another experiment: its network identity differs
    sys.modules.pop("fac_s50", None)
    Trainer(cfg, tmp_path / "run-helper", model_factory="fac_s50:net", quiet=True).run()
    again = json.loads((tmp_path / "run-helper" / "config.json").read_text())["model"]
    assert network_identity(again)["model_structure"] != network_identity(recorded)["model_structure"]
    config = json.loads((tmp_path / "run" / "config.json").read_text())["config"]
    assert experiment_settings(config, network=again) != experiment_settings(config, network=recorded)
