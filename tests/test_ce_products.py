"""The closed-form Gauss-Newton products of cross-entropy (flatfl/analysis/operators/cross_entropy.py): H_out u = a (p * u
- p (p . u)) per sample, against the Hessian of F.cross_entropy in the outputs from torch.autograd.functional, the
dense J^T H_out J of tiny models (several class counts, class weights, label smoothing, ignore_index, probability
targets, mean and sum, outputs shaped (N, C) and (N, C, L)) and the general double-backward path; the criteria it
must not take for cross-entropy go the general way; concave class weights refused in one line."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatfl.analysis import GGNOperator
from flatfl.analysis.operators import curvatures
from flatfl.analysis.operators.cross_entropy import CrossEntropyForm, SoftmaxHessian, cross_entropy_form
from flatfl.errors import ConfigError
from test_ggn_losses import dense_ggn

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

WEIGHT = torch.tensor([0.5, 2.0, 1.0, 1.5, 0.25, 3.0, 0.75], dtype=torch.float64)  # up to 7 classes


def criteria(classes: int) -> dict:
    """Recognised cross-entropy criteria for ``classes`` classes (ignore_index 1 is a class the targets use)."""
    w = WEIGHT[:classes]
    return {
        "F.cross_entropy": F.cross_entropy,
        "mean": nn.CrossEntropyLoss(),
        "sum": nn.CrossEntropyLoss(reduction="sum"),
        "weight": nn.CrossEntropyLoss(weight=w),
        "smoothing": nn.CrossEntropyLoss(label_smoothing=0.2),
        "ignore": nn.CrossEntropyLoss(ignore_index=1),
        "weight-smoothing-ignore": nn.CrossEntropyLoss(weight=w, label_smoothing=0.1, ignore_index=1),
        "weight-smoothing-sum": nn.CrossEntropyLoss(weight=w, label_smoothing=0.3, reduction="sum"),
    }


def classifier(classes: int):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, classes)).double()


def sequence_model(classes: int):
    """Scores (N, classes, L) from inputs (N, 3, L + 1): a convolution over the positions."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(3, 4, 2), nn.Tanh(), nn.Conv1d(4, classes, 1)).double()


def uneven(x, y):
    return [(x[:5], y[:5]), (x[5:], y[5:])]  # the sample-weighted mean of two batches' matrices


def general(criterion):
    """The same loss, not recognisable as cross-entropy: the double-backward path of OutputHessian."""
    return lambda outputs, targets: criterion(outputs, targets)


def products_three_ways(model, batches, criterion, monkeypatch):
    """(closed-form products, general-path products, dense J^T H_out J times the same vectors), float64."""
    closed = GGNOperator(model, batches, loss_fn=criterion)
    assert closed.method.cross_entropy is not None
    other = GGNOperator(model, batches, loss_fn=general(criterion))
    assert other.method.cross_entropy is None
    V = torch.randn(closed.dim, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    expected = other.matmat(V)
    with monkeypatch.context() as m:  # the closed form never builds the general output Hessian
        m.setattr(curvatures, "OutputHessian", None)
        found = closed.matmat(V)
    assert closed.method.general == set()
    dense = torch.from_numpy(dense_ggn(model, batches, criterion)) @ V
    return found, expected, dense


def assert_close(a, b, rtol):
    assert float((a - b).abs().max()) <= rtol * float(b.abs().max()), float((a - b).abs().max())


@pytest.mark.parametrize("classes", [2, 3, 7])
@pytest.mark.parametrize("name", list(criteria(7)))
def test_closed_form_ggn_is_the_general_path_and_the_dense_matrix(classes, name, monkeypatch):
    g = torch.Generator().manual_seed(classes)
    x = torch.randn(11, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (11,), generator=g)
    y[[0, 6]] = 1  # a target equal to ignore_index in each batch where the criterion has one
    found, expected, dense = products_three_ways(classifier(classes), uneven(x, y), criteria(classes)[name],
                                                 monkeypatch)
    assert_close(found, expected, 1e-13)
    assert_close(found, dense, 1e-12)


@pytest.mark.parametrize("name", ["mean", "weight-smoothing-ignore", "weight-smoothing-sum"])
def test_sequence_shaped_outputs(name, monkeypatch):
    """Outputs (N, C, L): one softmax per sample and position, targets (N, L)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 3, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (9, 4), generator=g)
    y[0, 0] = y[7, 2] = 1
    found, expected, dense = products_three_ways(sequence_model(4), uneven(x, y), criteria(4)[name], monkeypatch)
    assert_close(found, expected, 1e-13)
    assert_close(found, dense, 1e-12)


@pytest.mark.parametrize("shape", [(11, 5), (9, 5, 4)])
def test_probability_targets(shape, monkeypatch):
    """Soft labels (rows not summing to one as well) with class weights and label smoothing, mean and sum."""
    g = torch.Generator().manual_seed(4)
    if len(shape) == 2:
        model, x = classifier(5), torch.randn(shape[0], 4, generator=g, dtype=torch.float64)
    else:
        model, x = sequence_model(5), torch.randn(shape[0], 3, shape[2] + 1, generator=g, dtype=torch.float64)
    y = torch.rand(shape, generator=g, dtype=torch.float64) * 1.5
    for criterion in (nn.CrossEntropyLoss(weight=WEIGHT[:5], label_smoothing=0.1),
                      nn.CrossEntropyLoss(reduction="sum", label_smoothing=0.25)):
        found, expected, dense = products_three_ways(model, uneven(x, y), criterion, monkeypatch)
        assert_close(found, expected, 1e-13)
        assert_close(found, dense, 1e-12)


@pytest.mark.parametrize("classes", [1, 2, 50])
def test_softmax_hessian_is_the_hessian_of_cross_entropy_in_the_outputs(classes):
    """SoftmaxHessian.products against torch.autograd.functional.hessian of F.cross_entropy in its scores, for a
    batch (N, C) and one unbatched sample (C,), with weights and smoothing."""
    g = torch.Generator().manual_seed(classes)
    w = torch.rand(classes, generator=g, dtype=torch.float64) + 0.5
    form = CrossEntropyForm(w, 1, "mean", 0.15)  # class 1, where there is one, ignored
    batched = torch.randint(0, classes, (6,), generator=g)
    batched[0] = 0
    for shape, targets in (((6, classes), batched), ((classes,), torch.tensor(0))):
        z = torch.randn(shape, generator=g, dtype=torch.float64)
        U = torch.randn(3, *shape, generator=g, dtype=torch.float64)
        H = torch.autograd.functional.hessian(lambda f: form.loss(f.view(shape), targets), z.reshape(-1))
        found = SoftmaxHessian(form, z, targets).products(U).reshape(3, -1)
        assert torch.allclose(found, U.reshape(3, -1) @ H, rtol=0, atol=1e-15)


def test_float32_agrees_with_the_general_path():
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(11, 4, generator=g), torch.randint(0, 7, (11,), generator=g)
    model = classifier(7).float()
    criterion = nn.CrossEntropyLoss(weight=WEIGHT.float(), label_smoothing=0.1)
    closed = GGNOperator(model, uneven(x, y), loss_fn=criterion)
    other = GGNOperator(model, uneven(x, y), loss_fn=general(criterion))
    V = torch.randn(closed.dim, 4, generator=g)
    assert_close(closed.matmat(V), other.matmat(V), 1e-5)


class ScaledCrossEntropy(nn.CrossEntropyLoss):
    def forward(self, outputs, targets):
        return 2 * super().forward(outputs, targets)


def test_what_is_not_plain_cross_entropy_goes_the_general_way():
    """A subclass, reduction none, another function: not recognised; a forward hook changing the value: noticed on
    the first product, and the products are the dense matrix of the loss as computed."""
    assert cross_entropy_form(ScaledCrossEntropy()) is None
    assert cross_entropy_form(nn.CrossEntropyLoss(reduction="none")) is None
    assert cross_entropy_form(F.nll_loss) is None and cross_entropy_form(nn.MSELoss()) is None
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(11, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (11,), generator=g)
    hooked = nn.CrossEntropyLoss()
    hooked.register_forward_hook(lambda module, args, out: 2 * out)
    model = classifier(3)
    op = GGNOperator(model, uneven(x, y), loss_fn=hooked)
    V = torch.randn(op.dim, 2, generator=g, dtype=torch.float64)
    found = op.matmat(V)
    assert op.method.general == {0, 1}
    assert_close(found, torch.from_numpy(dense_ggn(model, uneven(x, y), hooked)) @ V, 1e-12)
    assert_close(found, 2 * GGNOperator(model, uneven(x, y)).matmat(V), 1e-13)


def test_a_negative_class_weight_is_refused_in_one_line():
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(11, 4, generator=g, dtype=torch.float64), torch.full((11,), 2)
    criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 1.0, -0.5], dtype=torch.float64), reduction="sum")
    op = GGNOperator(classifier(3), uneven(x, y), loss_fn=criterion)
    with pytest.raises(ConfigError) as e:
        op.matmat(torch.ones(op.dim, 1, dtype=torch.float64))
    message = str(e.value)
    assert "\n" not in message and "CrossEntropyLoss" in message and "concave" in message
    assert "evaluation batch 0" in message and "-0.5 < 0" in message
