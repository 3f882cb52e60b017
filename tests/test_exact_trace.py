"""The exact trace (flatfl/analysis/operators/exact_trace.py) against dense float64 matrices built here with
torch.func, parameter by parameter, for the Hessian, the GGN and the empirical Fisher; and the networks and losses it
refuses, each in one line: a tanh between layers (the Hessian's trace is then not the GGN's), a loss that is not
cross-entropy, a parametrised layer of another kind, a layer run twice, a parameter used outside its layer."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatfl.analysis.estimators.by_name import estimate_trace
from flatfl.analysis.operators.loss_curvature import curvature_operator
from flatfl.errors import ConfigError


class Net(nn.Module):
    """Convolution, ReLU, max pooling and two linear layers: linear in each layer's parameters."""

    def __init__(self, act=nn.ReLU):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1, stride=1)
        self.act1, self.pool, self.flat = act(), nn.MaxPool2d(2), nn.Flatten()
        self.fc1 = nn.Linear(3 * 3 * 3, 5)
        self.act2 = act()
        self.fc2 = nn.Linear(5, 4)

    def forward(self, x):
        return self.fc2(self.act2(self.fc1(self.flat(self.pool(self.act1(self.conv(x)))))))


def problem(act=nn.ReLU, seed=0):
    torch.manual_seed(seed)
    model = Net(act).double()
    x = torch.randn(19, 2, 6, 6, dtype=torch.float64)
    y = torch.arange(19) % 4
    return model, x, y, [(x[:7], y[:7]), (x[7:], y[7:])]  # unequal batches: the sample weights count


def dense(curvature: str, model, x, y):
    """The dense matrix, from torch.func alone."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    names = list(params)

    def unflat(v):
        out, i = {}, 0
        for n in names:
            out[n] = v[i:i + params[n].numel()].view(params[n].shape)
            i += params[n].numel()
        return out

    theta = torch.cat([p.reshape(-1) for p in params.values()])
    if curvature == "hessian":
        return torch.func.hessian(lambda v: F.cross_entropy(torch.func.functional_call(model, unflat(v), (x,)), y))(
            theta)
    if curvature == "ggn":
        J = torch.func.jacrev(lambda v: torch.func.functional_call(model, unflat(v), (x,)))(theta)  # (N, C, dim)
        p = torch.softmax(model(x).detach(), dim=1)
        H = torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)
        return torch.einsum("nci,ncd,ndj->ij", J, H, J) / len(y)
    G = torch.func.jacrev(lambda v: F.cross_entropy(torch.func.functional_call(model, unflat(v), (x,)), y,
                                                    reduction="none"))(theta)  # (N, dim)
    return G.T @ G / len(y)


@pytest.mark.parametrize("curvature", ["hessian", "ggn", "empirical-fisher"])
def test_the_exact_trace_is_the_dense_matrix_s_parameter_by_parameter(curvature):
    model, x, y, batches = problem()
    op = curvature_operator(curvature, model, batches)
    matrix = dense(curvature, model, x, y)
    result = estimate_trace(op, "exact")
    assert result.method == "exact" and result.hvps == 0 and op.hvps == 0
    assert abs(result.estimate - float(torch.trace(matrix))) <= result.stderr < 1e-11 * float(torch.trace(matrix))
    offset = 0
    for (name, p), value in zip(model.named_parameters(), result.info["per_parameter"].values()):
        block = torch.diagonal(matrix)[offset:offset + p.numel()].sum()
        assert value == pytest.approx(float(block), rel=1e-12, abs=1e-15), name
        offset += p.numel()
    assert list(result.info["per_parameter"]) == [n for n, _ in model.named_parameters()]


def test_the_hessian_s_trace_equals_the_ggn_s_only_where_the_check_lets_it():
    """With tanh the traces differ (by the dense matrices), and the exact trace of the Hessian is refused, naming
    the first layer whose output the network is not linear in; the GGN's is still computed."""
    model, x, y, batches = problem(nn.Tanh)
    assert abs(float(torch.trace(dense("hessian", model, x, y)) - torch.trace(dense("ggn", model, x, y)))) > 1e-3
    with pytest.raises(ConfigError, match=r"linear in each layer's parameters.* layer 'conv' .*hutchpp"):
        estimate_trace(curvature_operator("hessian", model, batches), "exact")
    ggn = estimate_trace(curvature_operator("ggn", model, batches), "exact")
    assert ggn.estimate == pytest.approx(float(torch.trace(dense("ggn", model, x, y))), rel=1e-12)


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.fc(x)))


class Outside(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x) + x[:, :3] * self.fc.bias  # the bias used once more, outside its layer


@pytest.mark.parametrize("model, loss, message", [
    (nn.Sequential(nn.Linear(4, 3)), nn.MSELoss(), "needs a cross-entropy loss"),
    (nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 3)), None, "layer '1' is a LayerNorm"),
    (Twice(), None, "each layer run once a pass, and layer 'fc' ran 2 times"),
    (Outside(), None, "different from the sum of its layers' per-sample gradients"),
])
def test_what_the_exact_trace_refuses(model, loss, message):
    torch.manual_seed(0)
    model = model.double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.arange(6) % 3
    if loss is not None:
        y = torch.randn(6, 3, dtype=torch.float64)
    op = curvature_operator("ggn", model, [(x, y)], loss_fn=loss)
    with pytest.raises(ConfigError) as e:
        estimate_trace(op, "exact")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_operator_that_is_no_model_s_curvature_is_refused():
    from flatfl.analysis.operators.linear_operator import MatrixOperator

    with pytest.raises(ConfigError, match="needs the curvature of a model's loss .* not a MatrixOperator"):
        estimate_trace(MatrixOperator(torch.eye(3, dtype=torch.float64)), "exact")


@pytest.mark.parametrize("n, out, positions, features", [(3, 2, 9, 5), (3, 8, 3, 9), (2, 4, 1, 6)])
def test_a_layer_s_per_sample_norms_by_each_contraction(n, out, positions, features):
    """The per-sample product, the Gram contraction (picked when cheaper: the second shape) and the one-position
    case all give ||delta_i windows_i^T||^2, written out here sample by sample."""
    from flatfl.analysis.operators.exact_trace import weight_norms

    g = torch.Generator().manual_seed(5)
    delta = torch.randn(n, out, positions, generator=g, dtype=torch.float64)
    windows = torch.randn(n, features, positions, generator=g, dtype=torch.float64)
    expected = torch.stack([(delta[i] @ windows[i].T).square().sum() for i in range(n)])
    torch.testing.assert_close(weight_norms(delta, windows), expected, rtol=1e-13, atol=0)


def test_per_layer_traces_are_exact_with_the_exact_trace():
    """--per-layer with the exact trace: each module's trace is the sum of its parameters' shares, the dense
    matrix's diagonal block trace, with no product spent on it (blocks too large to form)."""
    from flatfl.analysis.estimators.per_layer import per_layer_curvature

    model, x, y, batches = problem()
    op = curvature_operator("hessian", model, batches)
    matrix = dense("hessian", model, x, y)
    layers = per_layer_curvature(op, 1, trace_method="exact", dense_up_to=0, tol=1e-6)
    offset = 0
    for block in layers.blocks:
        want = float(torch.diagonal(matrix)[offset:offset + block.dim].sum())
        assert block.trace == pytest.approx(want, rel=1e-11, abs=1e-14) and block.trace_stderr < 1e-9 * abs(want) + 1e-15
        assert block.method == "lanczos+exact"
        offset += block.dim
    assert offset == op.dim
    # rounding bounds add up as bounds (not in quadrature): the blocks' sum states the whole trace's bound
    assert layers.trace_sum_stderr == pytest.approx(sum(b.trace_stderr for b in layers.blocks), rel=1e-12)


class Unused(nn.Module):
    """A layer never run and one whose output is dropped: both are rows and columns of zeros of every curvature."""

    def __init__(self):
        super().__init__()  # the dropped layer first: its gradients (none) must not be taken for the next layer's
        self.dropped, self.fc, self.spare = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        self.dropped(x)
        return self.fc(torch.relu(x))


@pytest.mark.parametrize("curvature", ["hessian", "ggn", "empirical-fisher"])
def test_layers_that_take_no_part_count_zero(curvature):
    torch.manual_seed(0)
    model = Unused().double()
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.arange(7) % 3
    op = curvature_operator(curvature, model, [(x, y)])
    result = estimate_trace(op, "exact")
    truth = float(torch.trace(op.matmat(torch.eye(op.dim, dtype=torch.float64))))
    assert result.estimate == pytest.approx(truth, rel=1e-12)
    shares = result.info["per_parameter"]
    assert all(shares[n] == 0.0 for n in ("spare.weight", "spare.bias", "dropped.weight", "dropped.bias"))
