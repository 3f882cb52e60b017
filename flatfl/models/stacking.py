"""Several clients' copies of one network, trained as one: channel stacking.

N copies of a convolutional network run as one network whose feature maps hold the copies side by side along the
channel axis: client k's channels are the k-th block of every feature map, (B, N*C, H, W). A convolution becomes a
grouped convolution (one group per client), a linear layer a batched matrix product, a GroupNorm of G groups one of
N*G groups and a BatchNorm over N*C channels keeps each client's running statistics apart; element-wise layers,
pooling and flattening act on each block unchanged (flattening (B, N*C, H, W) lays each client's C*H*W features
side by side). So one forward/backward pass trains N clients, and the gradient of the summed per-client losses with
respect to client k's block is client k's own gradient.

Every stacked parameter has a free view of shape (N, *the original shape), :meth:`StackedLayout.rows`; the flat
(N, dim) matrix of :class:`StackedLayout` orders each row exactly as :class:`~flatfl.models.params.ParamLayout`
orders the original model's flat vector. With N = 1 the stacked network is the original network itself (no
conversion), so one-at-a-time training is this code with N = 1.

Only flatfl's own layer types and model classes are channel-stacked (their forward passes are known to act per
channel), each module and parameter used at one place. Any other network - the user's own module, a layer used
twice, a tied weight, a buffer used in forward - is stacked by :mod:`flatfl.models.functional_stack` (the module's
own forward under ``torch.func.vmap``), which presents the same parameter layout, module names and stacked
activations; :func:`stacking_refusal` says why a network can be stacked by neither (it then trains one client at a
time), and :func:`stacking_path` which of the two stacks it.

Extension points (this module knows no regularizer or algorithm; those that need more of a stacked network supply
it here):

* :data:`STACKING_HOOKS` / :func:`on_stack`: functions ``hook(stacked, n)`` called on every channel-stacked network
  :func:`stack_network` builds (N > 1), after its layers are stacked: what a piece must set or guard on the copy;
* :class:`LayerAdapter`: another way to run a stacked layer for a while (``layer.adapter``), e.g. several
  sub-networks per client in one pass (:mod:`flatfl.models.canvas`);
* :attr:`StackedLayout.live`: the rows of a parameter that got no gradient in a backward pass, for a piece that runs
  a part of the network for some of the clients only (the SGD step skips those rows).
"""
from __future__ import annotations

import copy
import weakref
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .params import ParamLayout
from .slimmable import Slimmable, check_group_width, check_width
from .resnet import ResidualBlock

#: layers with no parameters that act on each channel block alone
ELEMENTWISE = (nn.ReLU, nn.Tanh, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Flatten, nn.Identity,
               nn.Sequential)


def _slim_sides(layer: nn.Module) -> tuple[bool, bool]:
    """(slim_in, slim_out) of a slimmable layer; (False, False) for a plain one (its width never changes)."""
    if isinstance(layer, Slimmable):
        return getattr(layer, "slim_in", True), getattr(layer, "slim_out", True)
    return False, False


class LayerAdapter(Protocol):
    """Another way to run a stacked layer, for a while: set as the layer's ``adapter``, it is called as
    ``adapter(layer, x)`` in place of the layer's own computation (reading the layer's weights, so gradients reach
    them); ``layer.adapter = None`` restores the layer. Every stacked layer class has the slot."""

    def __call__(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor: ...


class _StackedLayer(Slimmable):
    """What every stacked layer holds besides its weights: its width (1.0 until a piece slims the network) and its
    :class:`LayerAdapter` slot (None: the layer's own computation), set by :meth:`_start_slots`."""

    def _start_slots(self) -> None:
        self.width = 1.0
        self.adapter: LayerAdapter | None = None


class StackedConv2d(_StackedLayer, nn.Module):
    """N convolutions as one grouped convolution; weight (N*out, in/groups, kh, kw). At width w < 1 (a slimmable
    source layer) each client's convolution uses the leading ceil(w*C) of its channels, as the slimmable layer."""

    def __init__(self, conv: nn.Conv2d, n: int):
        super().__init__()
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.stride, self.padding, self.dilation, self.groups = conv.stride, conv.padding, conv.dilation, conv.groups
        self.weight = nn.Parameter(conv.weight.detach().repeat(n, 1, 1, 1))
        self.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach().repeat(n))
        self.slim_in, self.slim_out = _slim_sides(conv)
        self._start_slots()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.adapter is not None:
            return self.adapter(self, x)
        n = self.weight.shape[0] // self.out_channels
        if self.width == 1.0 or not (self.slim_in or self.slim_out):
            return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups * n)
        n_out, n_in = self.leading(self.out_channels, self.slim_out), self.leading(self.in_channels, self.slim_in)
        w = self.weight.view(n, self.out_channels, *self.weight.shape[1:])[:, :n_out, :n_in]
        bias = None if self.bias is None else self.bias.view(n, -1)[:, :n_out].reshape(-1)
        return F.conv2d(x, w.reshape(n * n_out, *w.shape[2:]), bias, self.stride, self.padding, self.dilation, n)


class StackedLinear(_StackedLayer, nn.Module):
    """N linear layers as one batched product; weight (N, out, in), bias (N, out); input (B, N*in) or (B, N, in),
    output (B, N, out).

    The output is a view of an (N, out, B) product (W_k x_k^T for each client): a following stacked linear layer
    reads it as its (N, in, B) operand without a copy, the weight's gradient comes out in the weight's own layout
    (no copy into ``.grad``), and the logits unstack to (N, B, K) without a copy. Element-wise layers between
    linear layers keep that layout. At width w < 1 (a slimmable source layer) each client uses the leading
    ceil(w*in) inputs (and outputs when ``slim_out``)."""

    def __init__(self, linear: nn.Linear, n: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().unsqueeze(0).repeat(n, 1, 1))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().unsqueeze(0).repeat(n, 1))
        self.slim_in, self.slim_out = _slim_sides(linear)
        self._start_slots()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.adapter is not None:
            return self.adapter(self, x)
        weight, bias = self.weight, self.bias
        if self.width != 1.0 and (self.slim_in or self.slim_out):
            n_in, n_out = self.leading(self.in_features, self.slim_in), self.leading(self.out_features, self.slim_out)
            weight = weight[:, :n_out, :n_in]
            bias = None if bias is None else bias[:, :n_out]
        return self.product(x, weight, bias)

    @staticmethod
    def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The batched product of the clients' (N, out, in) ``weight`` and (N, out) ``bias`` with their inputs
        (B, N*in) or (B, N, in): (B, N, out)."""
        n, b, n_in = weight.shape[0], x.shape[0], weight.shape[2]
        xt = x.reshape(b, n, n_in).permute(1, 2, 0)  # (N, in, B)
        if bias is None:
            out = torch.bmm(weight, xt)
        else:
            out = torch.baddbmm(bias.unsqueeze(2), weight, xt)
        return out.permute(2, 0, 1)  # (B, N, out)


class StackedGroupNorm(_StackedLayer, nn.Module):
    """N GroupNorms of G groups over C channels as one of N*G groups over N*C channels (at width w < 1: over each
    client's leading ceil(w*C) channels, G groups still)."""

    def __init__(self, norm: nn.GroupNorm, n: int):
        super().__init__()
        self.num_groups, self.num_channels, self.eps = norm.num_groups, norm.num_channels, norm.eps
        self.weight = None if norm.weight is None else nn.Parameter(norm.weight.detach().repeat(n))
        self.bias = None if norm.bias is None else nn.Parameter(norm.bias.detach().repeat(n))
        self.slim = isinstance(norm, Slimmable)
        self._start_slots()

    def check_width(self, width: float) -> float:
        """Validate ``width`` as the slimmable GroupNorm does (its channels must split into groups)."""
        return check_group_width(width, self.num_channels, self.num_groups) if self.slim else check_width(width)

    def set_width(self, width: float) -> None:
        self.width = self.check_width(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.adapter is not None:
            return self.adapter(self, x)
        c = self.leading(self.num_channels, self.slim)
        n = x.shape[1] // c
        weight, bias = self.weight, self.bias
        if c != self.num_channels and weight is not None:
            weight = weight.view(n, -1)[:, :c].reshape(-1)
            bias = bias.view(n, -1)[:, :c].reshape(-1)
        return F.group_norm(x, self.num_groups * n, weight, bias, self.eps)


class StackedBatchNorm2d(_StackedLayer, nn.BatchNorm2d):
    """N BatchNorms as one over N*C channels: batch statistics and running statistics per client. At width w < 1
    (a slimmable source layer) each client's leading ceil(w*C) channels, normalised as the slimmable layer does
    (batch statistics in training, running statistics untouched)."""

    def __init__(self, norm: nn.BatchNorm2d, n: int):
        super().__init__(norm.num_features * n, norm.eps, norm.momentum, norm.affine, norm.track_running_stats)
        self.per_client = norm.num_features
        self.slim = isinstance(norm, Slimmable)
        self._start_slots()
        with torch.no_grad():
            if norm.affine:
                self.weight.copy_(norm.weight.repeat(n))
                self.bias.copy_(norm.bias.repeat(n))
            if norm.track_running_stats:
                self.running_mean.copy_(norm.running_mean.repeat(n))
                self.running_var.copy_(norm.running_var.repeat(n))
                self.num_batches_tracked.copy_(norm.num_batches_tracked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.adapter is not None:
            return self.adapter(self, x)
        if self.width == 1.0 or not self.slim:
            return super().forward(x)
        c = self.leading(self.per_client)
        n = x.shape[1] // c

        def lead(t):
            return None if t is None else t.view(n, -1)[:, :c].reshape(-1)

        if self.training:
            return F.batch_norm(x, None, None, lead(self.weight), lead(self.bias), True, 0.0, self.eps)
        return F.batch_norm(x, lead(self.running_mean), lead(self.running_var), lead(self.weight), lead(self.bias),
                            False, 0.0, self.eps)


def channel_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be channel-stacked (a layer or model class whose forward pass is not known to act per
    channel block, a narrowed slimmable layer, a module registered at two places, a parameter shared by two
    modules), or None when it can."""
    from .contract import FeatureClassifier
    from .projection import ProjectionHeadModel

    known = (FeatureClassifier, ProjectionHeadModel, ResidualBlock)
    places: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) in places:  # stacking replaces a layer by walking its parent's children: one place only
            return f"{name} is the module {places[id(module)] or 'the model'} used a second time"
        places[id(module)] = name
    owners: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in owners:
            return f"{name} is the parameter {owners[id(p)]} shared (tied)"
        owners[id(p)] = name
    for name, module in model.named_modules():
        where = name or "the model"
        if isinstance(module, (nn.Conv2d, nn.Linear, nn.GroupNorm, nn.BatchNorm2d)):
            if getattr(module, "width", 1.0) != 1.0:
                return f"{where} runs at width {module.width} (a slimmed sub-network)"
            if isinstance(module, nn.Conv2d) and (module.padding_mode != "zeros" or isinstance(module.padding, str)):
                return f"{where} uses padding {module.padding!r} / {module.padding_mode}"
            if type(module).__module__.startswith(("torch.", "flatfl.")):
                continue
        if isinstance(module, ELEMENTWISE) or isinstance(module, known):
            if type(module).__module__.startswith(("torch.", "flatfl.")):
                continue
        return f"{where} is a {type(module).__name__}, whose forward pass flatfl cannot stack"
    return None


def stacking_path(model: nn.Module) -> str | None:
    """How :func:`stack_network` stacks ``model``: 'channels' (flatfl's stacked layers), 'torch.func' (the module's
    own forward under vmap, :mod:`flatfl.models.functional_stack`), or None when neither can
    (:func:`stacking_refusal`)."""
    from .functional_stack import functional_refusal, shared_refusal

    if shared_refusal(model) is not None:
        return None
    if channel_refusal(model) is None:
        return "channels"
    return "torch.func" if functional_refusal(model) is None else None


def stacking_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be stacked at all (None when it can be: channel-stacked, or by torch.func). What torch.func
    cannot run shows only when it runs: :func:`probe_stacking` before training, and any stacked forward raises
    :class:`~flatfl.models.functional_stack.StackingRefused` (one line naming the module and the operation)."""
    from .functional_stack import functional_refusal, shared_refusal

    why = shared_refusal(model)
    if why is not None or channel_refusal(model) is None:
        return why
    return functional_refusal(model)


def probe_stacking(model: nn.Module, x: torch.Tensor, n: int = 2) -> str | None:
    """Why ``n`` clients of ``model`` cannot train stacked (None when they can): :func:`stacking_refusal`, and for a
    network stacked by torch.func one training step of stacked clients on the inputs ``x`` (B, ...) compared with
    the network's own (:func:`~flatfl.models.functional_stack.probe_refusal`). Draws nothing from the run's random
    generators."""
    why = stacking_refusal(model)
    if why is not None or stacking_path(model) == "channels":
        return why
    from .functional_stack import probe_refusal

    return probe_refusal(model, stack_network(model, n), x)


#: functions ``hook(stacked, n)`` that :func:`stack_network` calls on every network it builds (N > 1), after its
#: layers are stacked and before it is returned: what a piece whose per-client behaviour the layers cannot know must
#: set or guard on the stacked copy (registered with :func:`on_stack`, by the module that defines the piece)
STACKING_HOOKS: list[Callable[[nn.Module, int], None]] = []


def on_stack(hook: Callable[[nn.Module, int], None]) -> Callable[[nn.Module, int], None]:
    """Add ``hook`` to :data:`STACKING_HOOKS` (once); returns it, so it serves as a decorator."""
    if hook not in STACKING_HOOKS:
        STACKING_HOOKS.append(hook)
    return hook


def stack_network(model: nn.Module, n: int) -> nn.Module:
    """N copies of ``model`` as one stacked network (each copy holding ``model``'s weights): channel-stacked when
    flatfl's stacked layers apply, else by torch.func (:func:`stacking_path`); ``model`` itself when N = 1. Raise
    ValueError when the network cannot be stacked (:func:`stacking_refusal`)."""
    if n == 1:
        return model
    why = stacking_refusal(model)
    if why is not None:
        raise ValueError(why)
    if stacking_path(model) == "torch.func":
        from .functional_stack import functional_stack

        stacked = functional_stack(model, n)
    else:
        stacked = copy.deepcopy(model)
        kinds = ((nn.BatchNorm2d, StackedBatchNorm2d), (nn.Conv2d, StackedConv2d), (nn.Linear, StackedLinear),
                 (nn.GroupNorm, StackedGroupNorm))
        for parent in list(stacked.modules()):
            for name, child in list(parent.named_children()):
                for kind, cls in kinds:
                    if isinstance(child, kind):
                        layer = cls(child, n)
                        for pname, p in child.named_parameters(recurse=False):  # a frozen layer stays frozen
                            getattr(layer, pname).requires_grad_(p.requires_grad)
                        setattr(parent, name, layer)
                        break
        for hook in STACKING_HOOKS:
            hook(stacked, n)
    stacked.flatfl_stacked = n
    stacked.flatfl_source = weakref.ref(model)  # not a submodule: the plain network the copies were made from
    return stacked.train(model.training)  # the new layers start in training mode: the model's mode throughout


def stacked_copy(model: nn.Module, n: int) -> nn.Module:
    """N copies of ``model`` as one network that is never ``model`` itself (for N = 1 a deep copy): a network to
    load other parameters into while ``model`` keeps its own."""
    return copy.deepcopy(model) if n == 1 else stack_network(model, n)


def stacked_clients(network: nn.Module) -> int:
    """How many clients' copies ``network`` holds side by side (1 for a network that :func:`stack_network` did not
    stack)."""
    return getattr(network, "flatfl_stacked", 1)


def source_network(network: nn.Module) -> nn.Module:
    """The plain network a stacked network was built from (``network`` itself when it is not stacked).

    What a regularizer or algorithm hooks is decided on this network and found in the stacked one by module name
    (:func:`counterparts`): stacking replaces layers by classes of its own (``nn.Linear`` by
    :class:`StackedLinear`, ...), so a choice made by layer class on the stacked network would differ."""
    ref = getattr(network, "flatfl_source", None)
    source = ref() if ref is not None else None
    if stacked_clients(network) > 1 and source is None:
        raise RuntimeError("a stacked network outlived the network it was built from")
    return network if source is None else source


def counterparts(network: nn.Module, modules: list[nn.Module]) -> list[nn.Module]:
    """The modules of ``network`` that are, by name, ``modules`` of its :func:`source_network` (``modules`` itself
    when ``network`` is not stacked). Raise ValueError for a module that is not a registered submodule of it."""
    source = source_network(network)
    if source is network:
        return list(modules)
    names = {id(m): name for name, m in source.named_modules()}
    missing = [type(m).__name__ for m in modules if id(m) not in names]
    if missing:
        raise ValueError(f"{missing[0]} is not a registered submodule of the network")
    return [network.get_submodule(names[id(m)]) for m in modules]


def stack_inputs(x: torch.Tensor) -> torch.Tensor:
    """(N, B, C, ...) -> (B, N*C, ...): client k's inputs in the k-th channel block (a view when N = 1)."""
    n, b = x.shape[0], x.shape[1]
    if n == 1:
        return x[0]
    return x.transpose(0, 1).reshape(b, n * x.shape[2], *x.shape[3:])


def unstack_outputs(y: torch.Tensor, n: int) -> torch.Tensor:
    """(B, N*K) or (B, N, K) -> (N, B, K): each client's outputs."""
    if n == 1 and y.dim() == 2:
        return y.unsqueeze(0)
    b = y.shape[0]
    return y.reshape(b, n, -1).transpose(0, 1)


def client_blocks(a: torch.Tensor, n: int) -> torch.Tensor:
    """A stacked activation (B, N*C, ...) or (B, N, C) as (B, N, C*...): client k's part in [:, k]."""
    return a.reshape(a.shape[0], n, -1)


class StackedLayout:
    """The trainable parameters of a stacked network as an (N, dim) matrix, one row per client, each row ordered as
    :class:`ParamLayout` orders the original model's flat vector."""

    def __init__(self, network: nn.Module, n: int, single: ParamLayout):
        self.n = n
        self.names = single.names
        self.shapes = single.shapes
        self.numels = single.numels
        self.dim = single.dim
        params = dict(network.named_parameters())
        self.params = [params[name] for name in self.names]
        for p, shape in zip(self.params, self.shapes):
            if p.numel() != n * shape.numel():
                raise ValueError("stacked network does not match its model")
        self.network = network
        self.buffer_names = [k for k, b in network.named_buffers() if b.is_floating_point()]
        #: parameter index -> (N,) 0/1, 0 for the clients whose row of it got no gradient in this step's backward
        #: pass (set by a piece that runs a part of the network for some clients only): a client alone would have
        #: left that parameter without a gradient and its SGD step would skip it; cleared by :meth:`grads` when a
        #: caller adds to every gradient. A parameter not named has a gradient in every row.
        self.live: dict[int, torch.Tensor] = {}

    def rows(self, t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """A stacked tensor as (N, *shape) (a view)."""
        return t.view(self.n, *shape)

    def param_rows(self) -> list[torch.Tensor]:
        return [self.rows(p, s) for p, s in zip(self.params, self.shapes)]

    def views(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """(N, dim) -> per-parameter (N, *shape) views (no copy)."""
        out, start = [], 0
        for numel, shape in zip(self.numels, self.shapes):
            out.append(matrix[:, start:start + numel].view(matrix.shape[0], *shape))
            start += numel
        return out

    def get(self) -> torch.Tensor:
        """The clients' parameters as a new (N, dim) matrix."""
        return torch.cat([r.detach().reshape(self.n, -1) for r in self.param_rows()], 1)

    @torch.no_grad()
    def set(self, matrix: torch.Tensor) -> None:
        torch._foreach_copy_(self.param_rows(), self.views(matrix.to(self.params[0].device)))

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The network's float buffers now, by name: a forward that assigns a buffer anew (``self.ema = 0.9 *
        self.ema + ...``) replaces the tensor, so a tensor held from before would be the stale one."""
        named = dict(self.network.named_buffers())
        return [named[name] for name in self.buffer_names]

    @torch.no_grad()
    def set_buffers(self, per_client: dict[str, torch.Tensor]) -> None:
        """Load float buffers, each given as (N, ...) rows or as one model's tensor for every client."""
        for name, b in zip(self.buffer_names, self.buffers):
            v = per_client[name].to(b.device)
            b.view(self.n, -1).copy_(v.reshape(self.n, -1) if v.numel() == b.numel() else v.reshape(1, -1))

    def get_buffers(self) -> dict[str, torch.Tensor]:
        """Each float buffer as (N, *the model's shape) rows (copies)."""
        return {name: b.detach().reshape(self.n, -1).clone() for name, b in zip(self.buffer_names, self.buffers)}

    def grads(self, touch: bool = True) -> list[torch.Tensor]:
        """Each parameter's gradient as (N, *shape) rows, created as zeros where backward left none. ``touch``: the
        caller writes every gradient (a correction term; one client alone then has a gradient for every parameter,
        so every row has one); False to read or scale them (clipping, the SGD step)."""
        if touch:
            self.live.clear()
        out = []
        for p, s in zip(self.params, self.shapes):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(self.rows(p.grad, s))
        return out

    @torch.no_grad()
    def add_to_grads(self, matrix: torch.Tensor, alpha: float = 1.0) -> None:
        """grad += alpha * matrix, row by row ((N, dim); a (dim,) vector is added to every row)."""
        if matrix.dim() == 1:
            matrix = matrix.unsqueeze(0).expand(self.n, -1)
        torch._foreach_add_(self.grads(), self.views(matrix), alpha=alpha)

    @torch.no_grad()
    def add_params_to_grads(self, alpha) -> None:
        """grad += alpha * theta; ``alpha`` a number or an (N,) tensor (one coefficient per client)."""
        if isinstance(alpha, torch.Tensor) and alpha.numel() > 1:
            scaled = [p * alpha.view(-1, *[1] * (p.dim() - 1)).to(p.dtype) for p in self.param_rows()]
            torch._foreach_add_(self.grads(), scaled)
        else:
            torch._foreach_add_(self.grads(), self.param_rows(), alpha=float(alpha))

    def row_norms(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of each row across all (N, ...) tensors together: (N,), with no host synchronisation."""
        if self.n == 1:  # the one-model norm, as torch.nn.utils computes it
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors))).reshape(1)
        # the same per client: one foreach norm of every (client, tensor) block, (P, N), normed over P
        per = torch.stack(torch._foreach_norm([row for t in tensors for row in t.unbind(0)]))
        return torch.linalg.vector_norm(per.view(len(tensors), self.n), dim=0)


def _gathered(t: torch.Tensor, n: int, rows: torch.Tensor) -> torch.Tensor:
    """The blocks ``rows`` of a stacked tensor, in the stacked layout of len(rows) clients."""
    m = rows.numel()
    per = t.view(n, -1)[rows]
    return per.view(t.shape[0] // n * m, *t.shape[1:])


def run_rows(network: nn.Module, layout: StackedLayout, rows: torch.Tensor, xs: torch.Tensor,
             method: str = "forward") -> torch.Tensor:
    """Run the stacked network for the clients ``rows`` only (their parameters gathered, so gradients reach just
    those blocks; BatchNorm running statistics updated for those clients only). ``xs`` holds len(rows) blocks."""
    n = layout.n
    from .functional_stack import is_functional_stack, run_clients

    if is_functional_stack(network):
        return run_clients(network, rows, xs, method)
    params = {name: _gathered(p, n, rows) for name, p in network.named_parameters()}
    buffers = {name: _gathered(b, n, rows) for name, b in network.named_buffers() if b.is_floating_point()}
    tensors = {**params, **buffers}
    if method == "forward":
        out = torch.func.functional_call(network, tensors, (xs,))
    else:  # another method of the network (features), through a module whose forward is that method
        caller = _MethodCaller(network, method)
        out = torch.func.functional_call(caller, {"net." + k: v for k, v in tensors.items()}, (xs,))
    if network.training and buffers:
        with torch.no_grad():
            named = dict(network.named_buffers())
            for name, b in buffers.items():
                named[name].view(n, -1)[rows] = b.view(rows.numel(), -1)
    return out



class _MethodCaller(nn.Module):
    """A module whose forward is ``method`` of ``net`` (so functional_call can substitute net's tensors)."""

    def __init__(self, net: nn.Module, method: str):
        super().__init__()
        self.net = net
        self.method = method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self.net, self.method)(x)
