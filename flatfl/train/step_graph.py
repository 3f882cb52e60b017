"""A cohort's local step launched as one CUDA graph (``--cuda-graphs``): the step's hundreds of kernels recorded once
a round and replayed, so a step costs one launch instead of one per kernel.

A graph replays fixed kernels on fixed memory, so it gives the eager step's numbers only when the step

* reads nothing from the host while it runs (no ``.item()``, ``bool(tensor)``, ``nonzero``: a synchronisation),
* takes no host data (no ``torch.tensor(...)`` of Python values, no host tensor as an operand of a device kernel),
* draws no random numbers (a replay would draw other numbers than the clients' own streams),
* keeps its state in place: every tensor that outlives the step (parameters, momentum, the algorithm's and the
  regularizer's state) is updated in place, never replaced by a new tensor (a replay would go on reading the old
  one); the parameters' gradients are the exception, made and used inside the step,
* changes no Python value (a counter, a flag: a replay does not run Python),
* has static shapes: every client of the cohort steps, on a full batch (the steps where some clients sit out or
  the last, partial batch run eagerly between replays).

:class:`StepProbe` checks the first five on one eager step, by watching every operation it dispatches and the
Python state of the pieces before and after. :class:`GraphedSteps` runs a cohort's full steps: the first eagerly
(lazily built state is made), the second eagerly under the probe, the third captured and replayed, the rest
replayed; a step the probe refuses, or a capture that fails, trains the cohort eagerly from there on and the
reason is reported once, in one line. The batch indices of each step are copied into one fixed device buffer
before the replay; the gather of the batch from the cohort's data is part of the graph.

``CAPTURES`` maps a device type to the class that records and replays a step there (:class:`CudaStepGraph`); a
graph replays what a recording did, and the tests check on the CPU, with a recording of the same semantics, that
replayed runs give the eager runs' numbers for every method of the registries (tests/test_step_graph.py).
"""
from __future__ import annotations

import contextlib
import traceback
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

#: operations that make the host wait for the device
SYNCS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique2, aten.unique_consecutive,
         aten.unique_dim, aten.equal}
#: indexing operations, which synchronise when an index is a boolean mask (its size is read by the host)
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
#: operations that draw random numbers (and every operation that takes a generator)
RANDOM = {aten.rand, aten.rand_like, aten.randn, aten.randn_like, aten.randint, aten.randint_like, aten.randperm,
          aten.bernoulli, aten.bernoulli_, aten.normal, aten.normal_, aten.uniform_, aten.exponential_,
          aten.cauchy_, aten.log_normal_, aten.geometric_, aten.random_, aten.multinomial, aten.poisson,
          aten.native_dropout, aten._fused_dropout, aten._standard_gamma, aten._sample_dirichlet, aten.binomial}
#: tensors made from Python data (``torch.tensor``, ``torch.as_tensor`` of a list)
FROM_HOST = {aten.lift_fresh, aten.lift_fresh_copy}
_ROOT = str(Path(__file__).resolve().parents[1])
#: packages whose objects hold no per-step Python state of flatfl's pieces (not walked)
FOREIGN = {"torch", "numpy", "builtins", "functools", "types", "typing"}
#: how many Python values of the pieces the probe compares at most (a bound on the walk)
STATE_LIMIT = 100_000


def fresh_outputs(func, out) -> list[torch.Tensor]:
    """The tensors an operation returned that it made (not views of its operands, not operands it wrote)."""
    returns = func._schema.returns
    if len(returns) == 1:
        return [] if returns[0].alias_info is not None else \
            [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    values = out if isinstance(out, (tuple, list)) else (out,)
    return [t for r, v in zip(returns, values) if r.alias_info is None
            for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)]


def _masks(indices) -> bool:
    """Whether an indexing operation's indices hold a boolean mask."""
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in tree_flatten(indices)[0])


def _takes_generator(func) -> bool:
    return any("Generator" in str(a.type) for a in func._schema.arguments)


class StepProbe(TorchDispatchMode):
    """Watches one eager step of a cohort on ``device`` and says why a graph could not replay it
    (:meth:`reasons`, empty when it could). ``pieces`` names the objects whose Python values must not change
    (algorithm, regularizer, optimizer, the cohort's scratch, the network's modules); the gradients of ``params``
    may outlive the step."""

    def __init__(self, device: torch.device, pieces: dict[str, Any], params: list[torch.Tensor]):
        super().__init__()
        self.device = torch.device(device)
        self.pieces = pieces
        self.params = params
        self.found: dict[str, str] = {}  # what, first seen at (the operation)
        self.made: list[weakref.ref] = []
        self._before: dict | None = None

    def __enter__(self):
        self._before = python_values(self.pieces)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        name = str(packet).removeprefix("aten.")
        if packet in SYNCS or packet in INDEXING and _masks(args[1]):
            self._found("a host synchronisation", name)
        if packet in RANDOM or _takes_generator(func):
            self._found("a random draw", name)
        if packet in FROM_HOST:
            self._found("a tensor made from host data", name)
        if self.device.type != "cpu":
            for a in tree_flatten((args, kwargs))[0]:
                if isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() > 0:
                    self._found("a host tensor as an operand", name)
                    break
        out = func(*args, **kwargs)
        self.made += [weakref.ref(t) for t in fresh_outputs(func, out)]
        return out

    def _found(self, what: str, op: str) -> None:
        if what not in self.found:
            self.found[what] = f"{op} at {_flatfl_line()}"

    def reasons(self) -> list[str]:
        """Why the step cannot be replayed (call after the step, once its results are dropped)."""
        out = [f"{what} ({op})" for what, op in self.found.items()]
        grads = {id(p.grad) for p in self.params if p.grad is not None}
        kept = [t for t in (r() for r in self.made) if t is not None and id(t) not in grads]
        if kept:
            shapes = ", ".join(str(tuple(t.shape)) for t in kept[:3])
            out.append(f"state replaced instead of updated in place ({len(kept)} tensors made by the step outlive "
                       f"it: {shapes})")
        changed = _changed(self._before, python_values(self.pieces))
        if changed:
            out.append(f"Python values change every step ({', '.join(changed[:3])})")
        return out


def _flatfl_line() -> str:
    """The innermost line of flatfl's code on the stack (what asked for an operation)."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(_ROOT) and not frame.filename.endswith("step_graph.py"):
            return f"{Path(frame.filename).relative_to(Path(_ROOT).parent)}:{frame.lineno}"
    return "outside flatfl"


def python_values(pieces: dict[str, Any]) -> dict[str, Any]:
    """The numbers, strings and flags that ``pieces`` (name -> object) hold, by path: their attributes and the items
    of their dicts, lists and tuples, through every object of Python classes (tensors, torch's and numpy's objects,
    functions and classes left out; at most ``STATE_LIMIT`` values, 8 levels deep)."""
    out: dict[str, Any] = {}
    seen: set[int] = set()

    def walk(obj, path: str, depth: int) -> None:
        if len(out) >= STATE_LIMIT or depth > 8:
            return
        if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
            out[path] = obj
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            out[path + "#len"] = len(obj)
            for k, v in list(obj.items()):
                walk(v, f"{path}[{k!r}]", depth + 1)
        elif isinstance(obj, (list, tuple)):
            out[path + "#len"] = len(obj)
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]", depth + 1)
        elif isinstance(obj, torch.nn.Module):  # its own values; its submodules are pieces of their own
            for k, v in vars(obj).items():
                if k not in ("_parameters", "_buffers", "_modules") and not k.endswith("hooks"):
                    walk(v, f"{path}.{k}", depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type) and \
                not type(obj).__module__.split(".")[0] in FOREIGN:
            for k, v in vars(obj).items():
                walk(v, f"{path}.{k}", depth + 1)

    for name, piece in pieces.items():
        walk(piece, name, 0)
    return out


def _changed(before: dict, after: dict) -> list[str]:
    return [k for k in sorted(set(before) | set(after)) if before.get(k, ...) != after.get(k, ...)]


class CudaStepGraph:
    """A step recorded as a CUDA graph (``torch.cuda.CUDAGraph``): :meth:`capture` records ``step()`` without
    running it, :meth:`replay` runs the recording. The eager steps before the capture run on a side stream
    (:meth:`warm_up`), as torch's whole-network capture does."""

    def __init__(self, device: torch.device):
        self.device = device
        self.graph = None
        self.side = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def warm_up(self):
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            yield
        current.wait_stream(self.side)

    def capture(self, step: Callable[[], None]) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


#: device type -> the class that records and replays a step there
CAPTURES: dict[str, type] = {"cuda": CudaStepGraph}


def capture_refusal(device: torch.device) -> str | None:
    """Why steps cannot be replayed as graphs on ``device`` (None when they can)."""
    if device.type not in CAPTURES:
        return f"--cuda-graphs needs a CUDA device (this run is on {device.type})"
    return None


class GraphedSteps:
    """A cohort's full steps (every client, a full batch of ``batch_size``): eager, probed, captured, replayed (see
    the module docstring). ``notice(line)`` reports once why the cohort trains eagerly instead."""

    def __init__(self, device: torch.device, clients: int, batch_size: int, *, pieces: dict[str, Any],
                 params: list[torch.Tensor], notice: Callable[[str], None]):
        self.device = device
        self.index = torch.zeros((clients, batch_size), dtype=torch.long, device=device)  # the fixed batch buffer
        self.pieces, self.params, self.notice = pieces, params, notice
        self.capturer = CAPTURES[device.type](device)
        self.taken = 0
        self.eager = False  # refused: every later step eager

    def stage(self, index) -> None:
        """Copy one step's batch indices, an (N, B) host array, into the fixed device buffer."""
        host = torch.from_numpy(index)
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.index.copy_(host, non_blocking=self.device.type == "cuda")

    def run(self, index, step: Callable[[torch.Tensor], None]) -> None:
        """One full step: ``step(index)`` gathers the batch with the device index tensor and trains."""
        self.stage(index)
        run = lambda: step(self.index)  # noqa: E731
        self.taken += 1
        if self.eager:
            run()
        elif self.taken == 1:
            with self.capturer.warm_up():
                run()
        elif self.taken == 2:
            probe = StepProbe(self.device, self.pieces, self.params)
            with self.capturer.warm_up():
                with probe:
                    run()
            why = probe.reasons()
            if why:
                self._refuse("; ".join(why))
        else:
            if self.taken == 3:
                try:
                    self.capturer.capture(run)
                except Exception as e:  # the step is untouched by a failed capture: run it eagerly
                    self._refuse(f"the capture failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
                    run()
                    return
            self.capturer.replay()

    def _refuse(self, why: str) -> None:
        self.eager = True
        self.notice(f"--cuda-graphs: steps run eagerly ({why})")
