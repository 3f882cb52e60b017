"""Fixtures shared by the test modules, and how the suite runs on several cores.

``python3 -m pytest -q`` runs the tests in pytest-xdist workers, one per usable core up to :data:`MAX_WORKERS`
(:func:`pytest_cmdline_main`; set here rather than in pyproject's ``addopts``, so that ``-p no:xdist`` still runs the
suite in one process, as ``-n 0`` does). The tests of a module that share a module-scoped fixture of that module run
in one worker, so that the fixture is built once (:func:`pytest_collection_modifyitems`); each worker gives torch
its share of the cores (:func:`pytest_configure`)."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

#: workers of the default parallel run at most (one per usable core below that); ``-n N`` / ``-n 0`` /
#: ``-p no:xdist`` choose otherwise, and so does PYTEST_XDIST_AUTO_NUM_WORKERS (pytest-xdist's own variable)
MAX_WORKERS = 4


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """No ``-n`` given: as many xdist workers as usable cores, at most MAX_WORKERS, and none on one core (before
    pytest-xdist's own hook reads the options)."""
    if not config.pluginmanager.hasplugin("xdist") or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # -p no:xdist, pytest-xdist not installed, or a worker (or a pytest started by a test in one)
    option = config.option
    if option.numprocesses is not None or option.dist != "no" or option.tx or config.getoption("usepdb", False):
        return  # -n, --dist, --tx or --pdb given: as asked
    asked = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").strip()
    workers = int(asked) if asked.isdigit() else min(_usable_cores(), MAX_WORKERS)
    if workers >= 2:
        option.numprocesses = workers
        option.dist = "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(pytest-xdist, in the controller, for each worker.) A worker reads the command line itself, without the
    ``--dist loadgroup`` that :func:`pytest_cmdline_main` set: it learns it here (see :func:`pytest_configure`)."""
    if node.config.getoption("dist") == "loadgroup":
        node.workerinput["flatfl_loadgroup"] = True


def pytest_configure(config):
    config.addinivalue_line("markers", "xdist_group(name): tests run in one pytest-xdist worker (-n)")
    if getattr(config, "workerinput", {}).get("flatfl_loadgroup"):
        config.option.loadgroup = True  # as pytest-xdist's worker sets it for --dist loadgroup: it names the groups
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if os.environ.get("PYTEST_XDIST_WORKER") and workers.isdigit():
        # torch's default is a thread per core in every worker: the workers' threads would fight over the cores
        torch.set_num_threads(max(1, _usable_cores() // int(workers)))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the groups
def pytest_collection_modifyitems(config, items):
    """A test that asks for a module-scoped fixture defined in its own module (a trained run, a report), itself or
    through the fixtures it asks for, joins that module's xdist group: those tests run in one worker, which builds
    the fixture once (a module's autouse fixtures count only where a test asks for them by name: every test of the
    module uses them, and would put the whole module in one worker). The group is named after the module: pytest-xdist
    shows its tests as ``tests/test_x.py::test_y@test_x``."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None or item.get_closest_marker("xdist_group"):
            continue
        module = item.nodeid.split("::")[0]
        asked, seen = list(info.argnames), set()
        while asked:
            name = asked.pop()
            defs = info.name2fixturedefs.get(name)
            if name in seen or not defs:
                continue
            seen.add(name)
            asked.extend(defs[-1].argnames)
            if defs[-1].scope in ("module", "package", "session") and defs[-1].baseid == module:
                item.add_marker(pytest.mark.xdist_group(module.rpartition("/")[2].removesuffix(".py")))
                break


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


def capture_pdf_pages(mp) -> list:
    """Through the monkeypatch ``mp``: the list of the figures every report written while it holds puts in its PDF,
    in order (the PDF is still written)."""
    import flatfl.report.pdf as report_pdf

    captured = []
    real = report_pdf.write_pdf

    def keep(pages, path):
        pages = list(pages)
        captured.extend(pages)
        return real(pages, path)

    mp.setattr(report_pdf, "write_pdf", keep)
    return captured


@pytest.fixture
def pdf_pages(monkeypatch):
    """The figures every report written during the test puts in its PDF, in order (the PDF is still written)."""
    return capture_pdf_pages(monkeypatch)


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


@contextlib.contextmanager
def _reports_undrawn(analyses: bool = False):
    from flatfl.report import figure_pages, pdf, pipeline
    from flatfl.utils.io import atomic_write_bytes

    def no_pages(*args, **kwargs):
        return []

    def empty_pdf(pages, path):
        pages = list(pages)
        atomic_write_bytes(path, b"")
        return len(pages)

    with pytest.MonkeyPatch.context() as mp:
        # the report's own names for what draws: the forest plot, its PNG / PDF bytes, the pages, the PDF
        mp.setattr(pipeline, "forest_figure", lambda results, ours_scale: None)
        mp.setattr(pipeline, "saved", lambda fig, fmt: b"")
        for name in ("table_pages", "other_pages", "run_pages"):
            mp.setattr(pipeline, name, no_pages)
        mp.setattr(figure_pages, "text_page", lambda *args, **kwargs: None)
        mp.setattr(pdf, "write_pdf", empty_pdf)
        if analyses:
            from flatfl.analysis.commands import hessian_command

            mp.setattr(hessian_command, "hessian_figures", lambda report, title: {})
        yield


@pytest.fixture(scope="session")
def reports_undrawn():
    """``with reports_undrawn(): ...``: every report written in the block has its tables, CSV files, report.md and
    summary.json as usual, but no figure is drawn: effects.png, effects.pdf and report.pdf are written empty, and the
    summary's pages are the first two only (effects, summary). With ``analyses=True``, ``flatfl hessian``'s figures
    (eigenvalues and density .png/.pdf) are not drawn either: not written, and not in hessian.json's file list.
    Drawing is most of a report's or a tiny run's time (matplotlib lays out every page); this is for the tests of the
    numbers and verdicts, whose figures other tests draw and check (tests/test_report_pages.py,
    tests/test_figures.py, the PDF tests of tests/test_report.py). Usable in module fixtures too."""
    return _reports_undrawn
