"""Several clients' copies of any network, trained as one: the module's own forward under ``torch.func.vmap``.

Where channel stacking (:mod:`flatfl.models.stacking`) does not apply - a network of the user's own classes, an
activation or normalisation it has no stacked layer for, a module used twice, parameters shared between modules -
N copies of a network run as the PyTorch model-ensembling recipe runs them: every parameter and floating-point
buffer holds the N clients' values as one (N, *shape) tensor, and each forward pass is ``vmap`` over the clients of
the module's own ``forward`` with each client's slices in place of the tensors (``torch.func.functional_call``'s
substitution, done here directly so that a buffer the forward assigns anew is kept). So one forward/backward pass
trains N clients, each with its own weights and its own running statistics, whatever the forward computes.

The stacked network is a deep copy of the network, with the same module names, so that what a regularizer or an
algorithm hooks (MAN's activations, FedAlign's last block, MOON's projection) is found by name as in a channel-stacked
network (:func:`flatfl.models.stacking.counterparts`). Forward hooks of its submodules cannot run inside ``vmap``
(their values are per-client tensors that must not leave it): while a stacked forward runs, each hooked submodule
records what it saw, the recorded tensors leave ``vmap`` as outputs in the stacked layout of a channel-stacked
network ((B, N, ...): client k's part in ``[:, k]``), and the hooks then run, in the order the forward reached them,
on those tensors. A tensor that reached two hooks reaches them as one tensor (FedAlign checks that its layers feed
each other). A hook may return its input unchanged (MAN's penalty node is a view of it), never another value.

Its parameters present the layout of :class:`~flatfl.models.stacking.StackedLayout`: row k of (N, *shape) is client
k's tensor, so the algorithms' and optimizers' per-client (N, dim) state applies unchanged. Tied parameters stay
tied (one (N, *shape) tensor for every module that holds it), a module used twice uses its one set of stacked
weights each time, and a frozen parameter stays frozen.

What ``vmap`` cannot run - a branch on a tensor's value, ``.item()``, a random draw (a client's draws come from its
own stream one at a time), an in-place write of per-client values into a tensor shared by all clients - raises
:class:`StackingRefused`, one line naming the module and the operation; :func:`probe_refusal` runs one stacked step
before training to find it then.
"""
from __future__ import annotations

import copy
import linecache
import types
import weakref

import torch
from torch import nn

__all__ = ["StackingRefused", "run_stacked", "run_clients", "functional_refusal", "functional_stack", "probe_refusal",
           "is_functional_stack", "shared_refusal"]


class StackingRefused(RuntimeError):
    """A network that ``torch.func`` cannot run for several clients at once: the message names the module and the
    operation (one line). The run then trains one client at a time."""


def _batch_norms(model: nn.Module):
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def shared_refusal(model: nn.Module) -> str | None:
    """Shapes of sharing that no stacked network can keep as one client alone keeps them (None: none): a BatchNorm
    with ``momentum=None``, whose running statistics are the cumulative average over ``num_batches_tracked``, a
    counter that one client at a time keeps across all the clients of a run in turn."""
    for name, m in _batch_norms(model):
        if m.momentum is None and m.track_running_stats:
            return (f"{name or 'the model'} is a {type(m).__name__} with momentum=None, a cumulative average over "
                    "num_batches_tracked, which one client at a time counts across all clients in turn")
    return None


def functional_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be stacked by :func:`functional_stack` before it runs (None when it may be: what
    ``vmap`` refuses shows when it runs, :func:`probe_refusal`)."""
    why = shared_refusal(model)
    if why is not None:
        return why
    from .resnet import ResidualBlock
    from .slimmable import Slimmable

    for name, m in model.named_modules():
        if isinstance(m, Slimmable) or (isinstance(m, ResidualBlock) and m.survival < 1.0):
            return (f"{name} is a {type(m).__name__}, whose per-client widths or block drops only channel stacking "
                    "runs, inside a module it cannot stack")
        if m._forward_hooks_with_kwargs or m._forward_pre_hooks_with_kwargs or m._backward_hooks or \
                getattr(m, "_backward_pre_hooks", None):
            return f"{name or 'the model'} ({type(m).__name__}) carries a hook that runs inside its forward"
    return None


def is_functional_stack(network: nn.Module) -> bool:
    return isinstance(getattr(network, "flatfl_functional", None), _Slots)


class _Slots:
    """Where each stacked tensor sits in the network: ``tensors`` the unique per-client tensors (parameters, then
    floating-point buffers), each with its (module, dict name, attribute) places."""

    def __init__(self):
        self.places: list[list[tuple[nn.Module, str, str]]] = []
        self.buffers: list[bool] = []  # whether tensor i is a buffer (may be assigned anew in forward)
        self.inside = False  # a stacked forward is running (under vmap)

    def current(self) -> list[torch.Tensor]:
        """The tensors now in place (the stacked ones, or those :func:`torch.func.functional_call` put there)."""
        return [getattr(places[0][0], places[0][1])[places[0][2]] for places in self.places]


def functional_stack(model: nn.Module, n: int) -> nn.Module:
    """N copies of ``model`` as one network run by ``vmap`` (module docstring). Raise ValueError when it cannot be
    (:func:`functional_refusal`)."""
    why = functional_refusal(model)
    if why is not None:
        raise ValueError(why)
    stacked = copy.deepcopy(model)  # keeps sharing: a module used twice, a tied parameter stay one object
    slots = _Slots()
    index: dict[int, int] = {}
    modules = list({id(m): m for m in stacked.modules()}.values())
    for kind in ("_parameters", "_buffers"):
        for m in modules:
            for attr, t in list(getattr(m, kind).items()):
                if t is None or (kind == "_buffers" and not t.is_floating_point()):
                    continue
                if id(t) not in index:
                    index[id(t)] = len(slots.places)
                    rows = t.detach().unsqueeze(0).repeat(n, *[1] * t.dim())
                    new = nn.Parameter(rows, requires_grad=t.requires_grad) if kind == "_parameters" else rows
                    slots.places.append([])
                    slots.buffers.append(kind == "_buffers")
                    index[id(new)] = index[id(t)]
                    setattr(slots, f"_t{index[id(t)]}", new)
                i = index[id(t)]
                getattr(m, kind)[attr] = getattr(slots, f"_t{i}")
                slots.places[i].append((m, kind, attr))
    for i in range(len(slots.places)):
        delattr(slots, f"_t{i}")
    stacked.flatfl_functional = slots
    for method in ("forward", "features"):
        if callable(getattr(type(stacked), method, None)):
            setattr(stacked, method, types.MethodType(_stacked_method(method), stacked))
    return stacked


def _stacked_method(method: str):
    def run(self: nn.Module, xs: torch.Tensor, *args, **kwargs):
        if self.flatfl_functional.inside:  # the module's own forward calling its own method (features): as is
            return getattr(type(self), method)(self, xs, *args, **kwargs)
        return run_stacked(self, method, xs, args, kwargs)

    run.__name__ = method
    return run


class _Recorder:
    """While a stacked forward runs under vmap: the hooks of the network's submodules replaced by recorders of what
    they saw (restored after)."""

    def __init__(self, net: nn.Module):
        self.hooked = [m for m in {id(m): m for m in net.modules()}.values()
                       if m is not net and (m._forward_hooks or m._forward_pre_hooks)]
        self.events: list[tuple[nn.Module, bool, tuple, object]] = []  # (module, pre, inputs, output)

    def __enter__(self):
        self.saved = [(m._forward_hooks, m._forward_pre_hooks) for m in self.hooked]
        for m in self.hooked:
            pre, post = m._forward_pre_hooks, m._forward_hooks
            m._forward_pre_hooks = {0: self._pre} if pre else {}
            m._forward_hooks = {0: self._post} if post else {}
        return self

    def _pre(self, module, inputs):
        self.events.append((module, True, inputs, None))

    def _post(self, module, inputs, output):
        self.events.append((module, False, inputs, output))

    def __exit__(self, *exc):
        for m, (post, pre) in zip(self.hooked, self.saved):
            m._forward_hooks, m._forward_pre_hooks = post, pre
        return False


def _leaves(events) -> list[torch.Tensor]:
    """The distinct tensors the recorded hooks saw (one entry per tensor object, in order)."""
    seen: dict[int, torch.Tensor] = {}
    for _, _, inputs, output in events:
        for t in (*inputs, output):
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen[id(t)] = t
    return list(seen.values())


def run_clients(net: nn.Module, rows: torch.Tensor, xs: torch.Tensor, method: str = "forward") -> torch.Tensor:
    """``method`` of the stacked network ``net`` for its clients ``rows`` only, on their stacked inputs ``xs``
    (len(rows) blocks): their rows of every tensor gathered, so gradients reach just those rows; the floating-point
    buffers they change (BatchNorm statistics) written back to those rows."""
    slots: _Slots = net.flatfl_functional
    tensors = slots.current()
    gathered = [t[rows] for t in tensors]
    out = run_stacked(net, method, xs, (), {}, gathered)
    if net.training:
        with torch.no_grad():
            for t, g, buffer in zip(tensors, gathered, slots.buffers):
                if buffer:
                    t[rows] = g
    return out


def run_stacked(net: nn.Module, method: str, xs: torch.Tensor, args: tuple, kwargs: dict,
         tensors: list[torch.Tensor] | None = None):
    """``method`` of the stacked network ``net`` on stacked inputs (B, M*C, ...) (with ``tensors`` in place of its
    own, one per slot: some of its clients' rows): vmap over the clients of the module's own method, then the
    submodules' hooks on what they saw."""
    slots: _Slots = net.flatfl_functional
    tensors = slots.current() if tensors is None else tensors
    m = tensors[0].shape[0] if tensors else net.flatfl_stacked
    b = xs.shape[0]
    x = xs.reshape(b, m, xs.shape[1] // m, *xs.shape[2:])
    plain = getattr(type(net), method)
    layout: dict = {}

    def one_client(values, xk):
        saved = [[getattr(mod, kind)[attr] for mod, kind, attr in places] for places in slots.places]
        for v, places in zip(values, slots.places):
            for mod, kind, attr in places:
                getattr(mod, kind)[attr] = v
        try:
            slots.inside = True
            with _Recorder(net) as rec:
                out = plain(net, xk, *args, **kwargs)
            assigned = {}
            for i, (v, places) in enumerate(zip(values, slots.places)):
                now = getattr(places[0][0], places[0][1])[places[0][2]]
                if now is not v:  # a buffer assigned anew in forward (self.b = ...): its new per-client value
                    assigned[i] = now
        finally:
            slots.inside = False
            for old, places in zip(saved, slots.places):
                for o, (mod, kind, attr) in zip(old, places):
                    getattr(mod, kind)[attr] = o
        leaves = _leaves(rec.events)
        layout["events"] = [(mod, pre, tuple(_find(leaves, t) for t in inputs),
                             None if pre else _find(leaves, output)) for mod, pre, inputs, output in rec.events]
        layout["assigned"] = sorted(assigned)
        layout["scalar"] = [t.dim() == 0 for t in leaves]
        return out, [t.unsqueeze(0) if t.dim() == 0 else t for t in leaves], [assigned[i] for i in sorted(assigned)]

    try:
        out, leaves, assigned = torch.func.vmap(one_client, in_dims=(0, 1), out_dims=(1, 1, 0),
                                                randomness="error")(tensors, x)
    except StackingRefused:
        raise
    except Exception as e:
        raise StackingRefused(_refusal(net, e)) from e
    if assigned:
        with torch.no_grad():
            for i, value in zip(layout["assigned"], assigned):
                tensors[i].copy_(value)
    if layout["events"]:
        leaves = [t.squeeze(0) if s else t for t, s in zip(leaves, layout["scalar"])]
        _replay(net, layout["events"], leaves)
    return out


def _find(leaves: list[torch.Tensor], t):
    if not isinstance(t, torch.Tensor):
        return ("value", t)
    return next(i for i, leaf in enumerate(leaves) if leaf is t)


def _replay(net: nn.Module, events, leaves: list[torch.Tensor]) -> None:
    """Run the hooks of the submodules in the order the forward reached them, on the stacked tensors they saw."""
    def value(ref):
        return ref[1] if isinstance(ref, tuple) else leaves[ref]

    names = None
    for module, pre, inputs, output in events:
        args = tuple(value(r) for r in inputs)
        hooks = module._forward_pre_hooks if pre else module._forward_hooks
        for hook in list(hooks.values()):
            result = hook(module, args) if pre else hook(module, args, value(output))
            if result is None:
                continue
            same = not pre and _same_memory(result, value(output))
            if not same:
                names = names or {id(m): n for n, m in net.named_modules()}
                raise StackingRefused(f"a forward {'pre-' if pre else ''}hook on {names.get(id(module), '?')} "
                                      f"({type(module).__name__}) changes its {'input' if pre else 'output'}")


def _same_memory(a, b) -> bool:
    """Whether ``a`` is ``b`` or a view of the very same elements of it (shape, memory and strides)."""
    if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.data_ptr() != b.data_ptr():
        return False
    return all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def _refusal(net: nn.Module, e: Exception) -> str:
    """One line: the innermost module of ``net`` whose forward raised ``e``, the line of its forward, the error."""
    names = {id(m): n for n, m in net.named_modules()}
    where, line = None, None
    tb = e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            where = (names[id(owner)] or "the model", type(owner).__name__)
            line = linecache.getline(frame.f_code.co_filename, tb.tb_lineno).strip()
        tb = tb.tb_next
    what = " ".join(str(e).split())
    for cut in (" Please ", " We don't support", " please file"):
        what = what.split(cut)[0]
    at = f"{where[0]} ({where[1]})" if where else "the model"
    return f"torch.func cannot run {at} for several clients at once" + (f" at `{line}`" if line else "") + \
        f": {what[:160]}"


def probe_refusal(model: nn.Module, stacked: nn.Module, x: torch.Tensor) -> str | None:
    """Why the stacked copy ``stacked`` of ``model`` cannot train its clients as ``model`` trains one (None when it
    can): one training forward and backward of two clients on ``x`` (a few of the data's inputs, (B, ...)), each
    client's outputs against ``model``'s own (a copy, in training mode), and every buffer that is not per client
    (an integer counter) left as it was, except BatchNorm's counter where the momentum makes it unused. Draws no
    random numbers from the run's generators; changes neither network."""
    n = getattr(stacked, "flatfl_stacked", 1)
    probe = copy.deepcopy(stacked).train()
    plain = copy.deepcopy(model).train()
    for mod in (*probe.modules(), *plain.modules()):
        mod._forward_hooks.clear()
        mod._forward_pre_hooks.clear()
    counters = {name: b.clone() for name, b in probe.named_buffers() if not b.is_floating_point()
                and not name.endswith("num_batches_tracked")}
    xs = x.unsqueeze(1).expand(x.shape[0], n, *x.shape[1:]).reshape(x.shape[0], n * x.shape[1], *x.shape[2:])

    with torch.random.fork_rng(devices=[x.device] if x.is_cuda else []):
        try:
            with torch.no_grad():
                ref = plain(x)
        except Exception:  # the network itself cannot take these inputs: not a matter of stacking
            return None
        try:
            y = probe(xs)  # stacked inputs (B, N*C, ...): each client's inputs in its channel block
            out = y.reshape(y.shape[0], n, -1).transpose(0, 1)
            out.sum().backward()
        except StackingRefused as e:
            return str(e)
        except Exception as e:
            return f"the backward pass of its stacked clients fails: {' '.join(str(e).split())[:160]}"
    scale = float(ref.abs().max()) or 1.0
    if float((out.detach() - ref.unsqueeze(0)).abs().max()) > 1e-4 * scale:
        return "its clients' outputs stacked differ from the network's own (a forward torch.func runs otherwise)"
    names = dict(probe.named_buffers())
    for name, before in counters.items():
        if not torch.equal(names[name], before):
            return (f"it writes its integer buffer {name} in forward, a count one client at a time keeps across "
                    "clients")
    return None

