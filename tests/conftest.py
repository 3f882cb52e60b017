"""Fixtures shared by the test modules."""
from __future__ import annotations

import contextlib

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch intra-op thread for the module's tests, restored afterwards: the tests' models are tiny, and on a
    shared 2-core machine a second thread only adds contention (several times slower). Use it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def received_settings(monkeypatch):
    """``received_settings(command, function, *flags)``: the settings object that ``flatfl <command> CHECKPOINT
    --out DIR [flags]`` passes to the library function it calls (``function``: its dotted path, replaced for the call
    by one that records it and stops with a ConfigError), as a dict of its fields. What a user gets when a flag is
    not given, read from the command's own behaviour rather than from click's parameter objects (whose ``default``
    of an unset flag changed between click releases)."""
    from click.testing import CliRunner

    from flatfl.cli import main
    from flatfl.errors import ConfigError

    def run(command: str, function: str, *flags: str) -> dict:
        received = {}

        def record(checkpoint, out, settings, *, quiet):
            received.update(settings.to_dict())
            raise ConfigError("recorded")

        monkeypatch.setattr(function, record)
        res = CliRunner().invoke(main, [command, "missing.pt", "--out", "unused", "--threads", "1", *flags])
        assert res.exit_code == 2 and "flatfl: error: recorded" in res.output, res.output  # stdout and stderr
        return received

    return run


@pytest.fixture
def crash_in_round():
    """``with crash_in_round(r): ...``: inside the block the trainer raises ``RuntimeError("simulated crash")`` when it
    starts round ``r`` (0-based), as a process killed there would stop; after it, training runs as usual."""
    from flatfl.train import engine

    @contextlib.contextmanager
    def crashing_at(index: int):
        orig = engine.Trainer.run_round

        def crashing(self, r):
            if r == index:
                raise RuntimeError("simulated crash")
            return orig(self, r)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(engine.Trainer, "run_round", crashing)
            yield

    return crashing_at


@pytest.fixture
def pdf_pages(monkeypatch):
    """The figures every report written during the test puts in its PDF, in order (the PDF is still written)."""
    import flatfl.report.pdf as report_pdf

    captured = []
    real = report_pdf.write_pdf

    def keep(pages, path):
        pages = list(pages)
        captured.extend(pages)
        return real(pages, path)

    monkeypatch.setattr(report_pdf, "write_pdf", keep)
    return captured


@pytest.fixture
def hold_lock():
    """``hold_lock(folder)``: another process takes ``folder``'s flatfl lock (as a running writer does) until the
    test ends."""
    from pathlib import Path

    from locks import start_lock_holder

    holders = []

    def hold(folder):
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        holders.append(start_lock_holder(folder))

    yield hold
    for proc in holders:
        proc.kill()
        proc.wait()


@pytest.fixture
def float64_default():
    """torch's default dtype float64 for a test, restored afterwards. Use it with
    ``pytestmark = pytest.mark.usefixtures("float64_default")``."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
