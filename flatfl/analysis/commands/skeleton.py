"""The skeleton every analysis command shares (``flatfl hessian``, ``hessian-clients``, ``surface``).

A command validates its typed settings, then :meth:`AnalysisCommand.open` checks ``--out``, resolves the device
(:func:`flatfl.utils.device.resolve_device`), refuses outputs in ``--out`` that flatfl did not write and loads the
checkpoint, in that order, before any work. The command builds its estimator's inputs and runs it under
:func:`progress_bar`; :meth:`AnalysisCommand.header` gives the fields every result file starts from (checkpoint,
round, weights digest, network, dataset, parameter count) and :func:`versions` those it ends with;
:meth:`AnalysisCommand.write` writes the figures and tables and the result JSON last, all or nothing.

Under torchrun every rank runs the command and computes the same numbers; the command's :attr:`AnalysisCommand.world`
says which rank writes (rank 0, or the only process), and every file of the command is written through
:meth:`AnalysisCommand.write` (or :meth:`AnalysisCommand.run_writer`, for a writer that renders and writes several
files itself), which do nothing on the other ranks: no command decides for itself who writes, and figures given as
functions are drawn only where they are written."""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from ...errors import ConfigError
from ...utils import ranks
from ...utils.device import resolve_device
from ...utils.io import atomic_write_many, json_safe
from ...utils.machine import machine
from ...utils.precision import float32_matmul_now, gpu_precision_notice, set_float32_matmul
from ...utils.provenance import settings_digest, state_digest

#: how analyses compute float32 products on CUDA: IEEE float32, never TF32 (flatfl.utils.precision); recorded in
#: every result file's header
ANALYSIS_FLOAT32 = "full"

__all__ = ["ANALYSIS_FLOAT32", "AnalysisCommand", "check_out_folder", "progress_bar", "versions", "weights_digest", "json_text",
           "write_result"]


def check_out_folder(out) -> Path:
    """``out`` as a Path; a ConfigError when it exists and is no folder."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    return out


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of a model's parameters and buffers (names, shapes and values): what a derived result came from
    (:func:`flatfl.utils.provenance.state_digest` of its state dict)."""
    return state_digest(model.state_dict())


def versions() -> dict:
    """The versions a result was computed with (the last fields of every result file before its file list)."""
    from ...version import __version__

    return {"flatfl_version": __version__, "torch_version": torch.__version__}


def json_text(result: Mapping) -> str:
    """A result as the JSON text flatfl writes (indented, numbers made JSON-safe, one final newline)."""
    return json.dumps(json_safe(result), indent=2, default=str) + "\n"


@contextlib.contextmanager
def progress_bar(quiet: bool = False, **options) -> Iterator:
    """A tqdm bar on stderr (none with ``quiet`` or when stderr is not a terminal), closed at the end."""
    from tqdm.auto import tqdm

    bar = tqdm(disable=quiet or not sys.stderr.isatty(), leave=False, **options)
    try:
        yield bar
    finally:
        bar.close()


class AnalysisCommand:
    """One analysis command's checkpoint, device and output folder (see the module docstring)."""

    def __init__(self, out: Path, device: torch.device, checkpoint, world: ranks.World | None = None) -> None:
        self.out = out
        self.device = device
        self.checkpoint = checkpoint
        self.world = world if world is not None else ranks.world()  # the ranks computing together (one process)

    @classmethod
    def open(cls, checkpoint, out, *, device, outputs, data_dir=None, model_factory: str | None = None,
             device_check: Callable[[torch.device], None] | None = None,
             precision: str | None = None) -> "AnalysisCommand":
        """Check ``out``, resolve ``device`` (then ``device_check(device)``), refuse any of ``outputs`` in ``out``
        that flatfl did not write, and load ``checkpoint`` in ``precision`` (None: the run's, so that an analysis
        of a float64 run computes in float64; float64 on a GPU is said once, as slow)."""
        out = check_out_folder(out)
        dev = ranks.join(resolve_device(device))  # under torchrun: the process group, this rank's device
        set_float32_matmul(ANALYSIS_FLOAT32)
        if device_check is not None:
            device_check(dev)
        from ...utils.manifest import refuse_foreign

        refuse_foreign(out, list(outputs))
        from ...checkpoint import load_checkpoint

        ckpt = load_checkpoint(checkpoint, device=dev, data_dir=data_dir, model_factory=model_factory,
                               precision=precision)
        notice = gpu_precision_notice(ckpt.precision, dev)
        if notice:
            print(notice, file=sys.stderr, flush=True)
        return cls(out, dev, ckpt, ranks.world())

    @property
    def title(self) -> str:
        """'network, round R': the figures' titles start with it."""
        return f"{self.checkpoint.model_spec.get('name')}, round {self.checkpoint.round}"

    def header(self, *, digest: str | None = None, network_key: str = "model", num_params: int | None = None) -> dict:
        """The provenance record every result file starts with: checkpoint, round, weights_sha256 (``digest``, else
        computed), the run's settings digest (``run_settings_sha256``, :func:`flatfl.utils.provenance.settings_digest`
        of the checkpoint's config), the network's name (under ``network_key``), dataset and parameter count, in
        that order, then how float32 products ran (``float32_matmul``), the floating type of the model, data and
        products (``precision``, :mod:`flatfl.utils.precision`) and the machine (``machine``,
        :func:`flatfl.utils.machine.machine`); :func:`versions` gives the flatfl and torch versions the file ends
        with."""
        ckpt = self.checkpoint
        head = {"checkpoint": str(ckpt.path), "round": ckpt.round,
                "weights_sha256": digest if digest is not None else weights_digest(ckpt.model),
                "run_settings_sha256": settings_digest(ckpt.config)}
        head[network_key] = ckpt.model_spec.get("name")
        head["dataset"] = ckpt.dataset_name
        head["num_params"] = ckpt.num_params if num_params is None else num_params
        head["float32_matmul"] = float32_matmul_now()
        head["precision"] = ckpt.precision
        head["machine"] = machine(self.device)
        return head

    @property
    def writes(self) -> bool:
        """Whether this process writes the command's files: rank 0 of the world, or the only process."""
        return self.world.main

    def write(self, files: Mapping[str, bytes | str | Callable[[], bytes | str]], result_name: str,
              result: Mapping) -> dict:
        """On the writing rank (:attr:`writes`): write ``files`` (name -> content, or a function drawing it) and then
        the result JSON ``result_name`` into the output folder, all or nothing (a full disk leaves the folder as it
        was); returns path -> content of what was written ({} on the other ranks, which draw nothing)."""
        if not self.writes:
            return {}
        contents = {name: content() if callable(content) else content for name, content in files.items()}
        return write_result(self.out, contents, result_name, result)

    def run_writer(self, writer: Callable, *args, **kwargs):
        """``writer(*args, **kwargs)`` on the writing rank alone (a writer that renders and writes several files
        itself); None on the other ranks."""
        return writer(*args, **kwargs) if self.writes else None


def write_result(out: Path, files: Mapping[str, bytes | str], result_name: str, result: Mapping) -> dict:
    """Write ``files`` (name -> content) and then the result JSON ``result_name`` into ``out``, all or nothing;
    returns path -> content of what was written."""
    out.mkdir(parents=True, exist_ok=True)
    payloads = {out / name: data for name, data in files.items()}
    payloads[out / result_name] = json_text(result)
    atomic_write_many(payloads)  # all or nothing: a full disk leaves the folder as it was
    return payloads
