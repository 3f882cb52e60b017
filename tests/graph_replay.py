"""A CUDA graph's semantics on the CPU, for the tests of flatfl.train.step_graph.

:class:`RecordedStep` has the interface of :class:`flatfl.train.step_graph.CudaStepGraph`. ``capture(step)`` runs
``step()`` once under a dispatch mode that records every operation that computes something (views and allocations
launch nothing) with the tensors it read and wrote, then puts back every tensor that existed before the step and
that the step wrote: like a CUDA capture, it leaves no effect but the Python one (``p.grad`` bound to the recorded
gradients). ``replay()`` runs the recorded operations again on the recorded tensors: an in-place operation writes
its operands again, any other operation's results are copied into the tensors the recording made (a CUDA graph's
fixed addresses). So a replay reads what lies in the recorded tensors now, bakes in the Python numbers and host
data of the recording, draws new random numbers, and never sees a tensor that replaced a recorded one: exactly
what makes a CUDA graph give other numbers than the eager step.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from flatfl.train.step_graph import SYNCS, fresh_outputs

aten = torch.ops.aten
#: operations that launch no kernel although they are not views
ALLOCATIONS = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
               aten.set_, aten.resize_, aten.record_stream}


#: operations that write their running statistics (arguments 3 and 4) when training (argument 5) without saying so
#: in their schema
UNANNOTATED_WRITES = {aten.native_batch_norm, aten.cudnn_batch_norm, aten.miopen_batch_norm}


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an operation writes in place (its arguments annotated as written, and batch norm's running
    statistics)."""
    out = []
    if func.overloadpacket in UNANNOTATED_WRITES and args[5]:
        out += [t for t in args[3:5] if isinstance(t, torch.Tensor)]
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name)
        out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out


def _memory(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []
        self.kept: list[torch.Tensor] = []  # every tensor the step made (kept: its memory stays its own)
        self.made: set[int] = set()  # the memory (storage) of the tensors the step made (not views)
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor from before the step, its old value)
        self._saved_ids: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in SYNCS:
            raise RuntimeError(f"operation not permitted when stream is capturing ({func})")
        for t in _written(func, args, kwargs):
            if _memory(t) not in self.made and id(t) not in self._saved_ids:
                self._saved_ids.add(id(t))
                self.saved.append((t, t.detach().clone()))
        out = func(*args, **kwargs)
        fresh = fresh_outputs(func, out)
        self.kept += fresh
        self.made.update(_memory(t) for t in fresh)
        if not (func.is_view or func.overloadpacket in ALLOCATIONS):
            self.ops.append((func, args, kwargs, fresh))
        return out


class RecordedStep:
    """A step recorded and replayed with a CUDA graph's semantics (the module docstring)."""

    replays = 0  # how many steps were replayed (all instances)

    def __init__(self, device: torch.device):
        self.device = device
        self.ops = None

    def warm_up(self):
        return contextlib.nullcontext()

    def capture(self, step) -> None:
        rec = _Recorder()
        try:
            with rec:
                step()
        finally:  # a capture, failed or not, leaves the tensors as they were
            with torch.no_grad():
                for t, old in reversed(rec.saved):
                    t.copy_(old)
        self.ops = rec.ops

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, outs in self.ops:
                for mine, new in zip(outs, fresh_outputs(func, func(*args, **kwargs))):
                    mine.copy_(new)
        RecordedStep.replays += 1
