"""The local regularizers (docs/update-rules.md §16-19) against hand computations, numpy and explicitly written formulas,
and composed with FL algorithms through the real engine on the embedded digits."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatfl.errors import ConfigError
from flatfl.models import build_model
from flatfl.models.cnn import CifarCNN, DigitsCNN
from flatfl.models.slimmable import SLIMMABLE_TYPES
from flatfl.train.catalog import load_all
from flatfl.train.components import LOCAL_OPTIMIZERS
from flatfl.models.params import ParamLayout
from flatfl.models.stacking import StackedLayout
from flatfl.train.context import ClientContext, Cohort, RoundContext, StepContext
from flatfl.train.regularizers.asd import ASD
from flatfl.train.regularizers.fedalign import FedAlign, spectral_norm, transmitting_matrix
from flatfl.train.regularizers.gradaug import GradAug, resolutions
from flatfl.train.regularizers.man import MAN
from flatfl.train.regularizers.mixup import Mixup, beta_distribution, sample_mix
from flatfl.train.regularizers.stochdepth import StochDepth

load_all()
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ----------------------------------------------------------------------------------------------------- helpers
def make_reg(cls, num_classes=10, **settings):
    return cls(cls.resolve(settings), num_classes=num_classes)


def make_step(model, x, y, *, label_counts=None, teacher=None, num_classes=10, rng_seed=0) -> StepContext:
    """A one-client cohort around ``model`` (N = 1: the network is the model itself) and its step on the batch
    (x, y), given with the leading client dimension: x (1, B, ...), y (1, B). The client's in-model random stream
    (Mixup's draws) is seeded with ``rng_seed``."""
    counts = label_counts if label_counts is not None else torch.bincount(y, minlength=num_classes)
    rctx = RoundContext(0, 0.1, torch.zeros(1), build_model=lambda: teacher)
    cctx = ClientContext(client_id=0, round=rctx, x=x, y=y, num_samples=len(y), weight=1.0,
                         label_counts=counts, steps=1, lr=0.1, generator=torch.Generator().manual_seed(0),
                         rng_state=torch.Generator().manual_seed(rng_seed).get_state())
    cohort = Cohort([cctx], rctx, model, StackedLayout(model, 1, ParamLayout(model)), 0.1)
    return StepContext(cohort, x.unsqueeze(0), y.unsqueeze(0))


def one_loss(losses: torch.Tensor) -> torch.Tensor:
    """The one client's loss of a one-client step's per-client losses, which must have shape (1,)."""
    assert losses.shape == (1,), losses.shape
    return losses[0]


def grads_of(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def zero_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


def np_log_softmax(z):
    z = z - z.max(1, keepdims=True)
    return z - np.log(np.exp(z).sum(1, keepdims=True))


def np_ce(z, y):
    return -np_log_softmax(z)[np.arange(len(y)), y].mean()


# --------------------------------------------------------------------------------------------------------- MAN
def test_man_hooks_capture_exactly_the_cifar_cnn_activations_of_spec_16():
    torch.manual_seed(0)
    model = CifarCNN(100)
    reg = make_reg(MAN, zeta=0.15)
    reg.attach(model)
    x = torch.randn(2, 3, 32, 32)
    logits, terms = reg.capture(model, x)
    # the four post-ReLU activations of the FedDyn/MAN code, built by hand: conv1, conv2 before pooling, fc1, fc2
    with torch.no_grad():
        a1 = F.relu(model.conv1(x))
        a2 = F.relu(model.conv2(F.max_pool2d(a1, 2)))
        a3 = F.relu(model.fc1(F.max_pool2d(a2, 2).flatten(1)))
        a4 = F.relu(model.fc2(a3))
    assert [tuple(a.shape) for a in (a1, a2, a3, a4)] == [(2, 64, 28, 28), (2, 64, 10, 10), (2, 384), (2, 192)]
    assert len(terms) == 4  # the logits are not a term
    for t, a in zip(terms, (a1, a2, a3, a4)):
        per_sample = (a ** 2).flatten(1).mean(1)  # mean over non-batch elements, then mean over the batch
        assert torch.allclose(t.detach(), per_sample.mean(), rtol=1e-5)
    assert torch.allclose(logits, model.classifier(a4), atol=1e-6)


def test_man_loss_and_gradient_equal_an_explicit_functional_formula():
    torch.manual_seed(1)
    model = DigitsCNN(10)
    zeta = 0.8
    reg = make_reg(MAN, zeta=zeta)
    reg.attach(model)
    x, y = torch.randn(5, 1, 8, 8), torch.tensor([0, 3, 3, 7, 9])
    loss = one_loss(reg.forward(make_step(model, x, y)))
    loss.backward()
    got = grads_of(model)

    # the same objective written out with functional ops on copies of the parameters
    p = {n: t.detach().clone().requires_grad_(True) for n, t in model.named_parameters()}
    a1 = torch.relu(F.conv2d(x, p["conv1.weight"], p["conv1.bias"], padding=1))
    a2 = torch.relu(F.conv2d(F.max_pool2d(a1, 2), p["conv2.weight"], p["conv2.bias"], padding=1))
    a3 = torch.relu(F.linear(F.max_pool2d(a2, 2).flatten(1), p["fc1.weight"], p["fc1.bias"]))
    z = F.linear(a3, p["classifier.weight"], p["classifier.bias"])
    ce = F.cross_entropy(z, y)
    act = sum((a ** 2).sum() / a.numel() for a in (a1, a2, a3))  # Eq. 16-18: 1/(B C H W) sum of squares
    expected = ce + zeta / 2 * act
    expected.backward()
    assert torch.allclose(loss, expected, rtol=1e-6)
    for (name, t), g in zip(model.named_parameters(), got):
        assert torch.allclose(g, p[name].grad, rtol=1e-5, atol=1e-7), name
    # the penalty really changes the gradient
    ce_only = torch.autograd.grad(F.cross_entropy(model(x), y), [model.conv1.weight])[0]
    assert not torch.allclose(got[0], ce_only, rtol=1e-3)


def plain_man_closure(model, x, y, zeta, record):
    """The MAN objective computed independently of flatfl's MAN: plain forward hooks keep each hooked module's
    output, and autograd differentiates CE + zeta/2 * sum(a.pow(2).mean())."""
    acts = []
    handles = [m.register_forward_hook(lambda mod, inp, out: acts.append(out)) for m in model.activation_modules()]

    def closure():
        for p in model.parameters():
            p.grad = None
        acts.clear()
        logits = model(x)
        reg = sum(a.pow(2).mean() for a in acts)
        loss = F.cross_entropy(logits, y) + zeta / 2 * reg
        loss.backward()
        record.append((float(reg.detach()), [a.numel() for a in acts], grads_of(model)))
        return loss

    return closure, handles


@pytest.mark.parametrize("arch", ["cifar-cnn", "resnet20"])
@pytest.mark.parametrize("local_opt", ["sgd", "sam"])
def test_man_penalty_and_gradients_equal_plain_autograd_through_sgd_and_sam_steps(arch, local_opt):
    """Two local steps of the engine's SGD / SAM with MAN's loss, against the same steps with the penalty written as
    plain autograd over activations captured by separate hooks: every pass's penalty value, layer count and gradient,
    and the parameters after the steps. Batches large enough that the conv layers take the blocked float64 path.
    In float64: in float32, a 1e-7 rounding difference that flips one ReLU near 0 changes the next step's gradient
    by 1e-3, for this code and the previous one alike."""
    from flatfl.train.regularizers.man import BLOCK

    torch.manual_seed(13)
    model = (CifarCNN(10) if arch == "cifar-cnn" else build_model("resnet20", 10, 3, 32)).double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(6, 3, 32, 32, dtype=torch.float64), torch.randint(0, 10, (6,))
    zeta = 0.6
    reg = make_reg(MAN, zeta=zeta)
    reg.attach(model)
    opt_cls = LOCAL_OPTIMIZERS[local_opt]
    hp = opt_cls.resolve({})
    got, want = [], []

    def man_closure():
        for p in model.parameters():
            p.grad = None
        step = make_step(model, x, y)
        loss = reg.forward(step)
        one_loss(loss).backward()
        got.append((float(one_loss(step.scratch["man_reg"])), None, grads_of(model)))
        return loss

    ce_grad = torch.autograd.grad(F.cross_entropy(reference(x), y), next(reference.parameters()))[0]
    plain_closure, handles = plain_man_closure(reference, x, y, zeta, want)
    man_opt = opt_cls(StackedLayout(model, 1, ParamLayout(model)), lr=0.1, hp=hp)
    ref_opt = opt_cls(StackedLayout(reference, 1, ParamLayout(reference)), lr=0.1, hp=hp)
    for _ in range(2):
        man_loss = one_loss(man_opt.step(man_closure, lambda: None))
        ref_loss = ref_opt.step(lambda: plain_closure().reshape(1), lambda: None)
        assert torch.allclose(man_loss, one_loss(ref_loss), rtol=1e-12)
    for h in handles:
        h.remove()

    passes = 2 if local_opt == "sgd" else 4  # SAM: each step's two passes, each with its own activations
    assert len(got) == len(want) == passes
    layers = len(model.activation_modules())
    assert all(len(n) == layers for _, n, _ in want) and layers == (4 if arch == "cifar-cnn" else 9)
    assert any(n > BLOCK and n % BLOCK for n in want[0][1])  # a blocked layer with a tail
    for (reg_got, _, g_got), (reg_want, _, g_want) in zip(got, want):
        assert reg_got == pytest.approx(reg_want, rel=1e-12)
        for (name, _), a, b in zip(model.named_parameters(), g_got, g_want):
            assert torch.allclose(a, b, rtol=1e-9, atol=1e-12), (name, float((a - b).abs().max()))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-10, atol=1e-12), name
    assert not torch.allclose(ce_grad, got[0][2][0], rtol=1e-3)  # the penalty really moves the gradient


def test_man_value_is_float64_accurate_at_25m_elements():
    """Issue 17.3: float32 norms drift by 1e-2 relative at 25M elements; the logged value (the penalty's forward and
    MAN.capture's per-layer terms) must stay within 1e-6 of the float64 sum, and the gradient stay 2 a / numel."""
    from flatfl.train.regularizers.man import mean_square, sum_of_mean_squares

    g = torch.Generator().manual_seed(0)
    big = torch.relu(torch.randn(100, 250_000, generator=g)) * 2 + 0.5  # 25M elements, mean square ~2.9
    odd = torch.rand(3, 70_001, generator=g) + 1.0  # over one block, not a multiple of it: a tail
    small = torch.rand(7, 5, generator=g)
    layers = [big, odd, small]
    want = sum(float((a.double() ** 2).sum()) / a.numel() for a in layers)
    got = float(sum_of_mean_squares(layers))
    assert abs(got - want) <= 1e-6 * want, (got, want)
    for a in layers:
        ref = float((a.double() ** 2).mean())
        assert abs(float(mean_square(a)) - ref) <= 1e-6 * ref
    leaves = [odd.clone().requires_grad_(True), small.clone().requires_grad_(True)]
    sum_of_mean_squares(leaves).backward()
    for leaf in leaves:
        assert torch.allclose(leaf.grad, 2 * leaf.detach() / leaf.numel(), rtol=1e-6)


def test_man_records_only_its_own_forward_not_copies_and_clears_each_pass():
    torch.manual_seed(2)
    model = DigitsCNN(10)
    reg = make_reg(MAN, zeta=1.0)
    reg.attach(model)
    teacher = copy.deepcopy(model)  # a deep copy carries the hook functions: they must not fire for it

    class WithTeacher(nn.Module):
        def __init__(self):
            super().__init__()
            self.student, self.teacher = model, teacher

        def forward(self, x):
            with torch.no_grad():
                self.teacher(x)
            return self.student(x)

    x, y = torch.randn(4, 1, 8, 8), torch.tensor([1, 2, 3, 4])
    _, alone = reg.capture(model, x)
    _, with_teacher = reg.capture(WithTeacher(), x)
    assert len(alone) == len(with_teacher) == 3
    assert all(torch.equal(a, b) for a, b in zip(alone, with_teacher))
    model(x)  # a forward outside MAN's own (evaluation, another piece's extra pass) records nothing
    first = one_loss(reg.forward(make_step(model, x, y)))
    second = one_loss(reg.forward(make_step(model, x, y)))  # SAM's second pass: the same terms, not twice as many
    assert torch.equal(first, second)
    expected = F.cross_entropy(model(x), y) + 0.5 * sum(alone)
    assert torch.allclose(first, expected, rtol=1e-6)


def test_man_fallback_hooks_nonlinearities_before_the_final_linear():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 5), nn.ReLU(inplace=True), nn.Linear(5, 4), nn.GELU(),
                          nn.Linear(4, 3), nn.ReLU())
    reg = make_reg(MAN, zeta=2.0)
    reg.attach(model)
    assert reg.hooked_modules == [model[2], model[4]]  # the ReLU after the logits layer is excluded
    assert model[2].inplace is False
    x, y = torch.randn(3, 1, 2, 3), torch.tensor([0, 1, 2])
    loss = one_loss(reg.forward(make_step(model, x, y, num_classes=3)))
    h1 = torch.relu(model[1](x.flatten(1)))
    h2 = F.gelu(model[3](h1))
    expected = F.cross_entropy(model(x), y) + 1.0 * ((h1 ** 2).mean() + (h2 ** 2).mean())
    assert torch.allclose(loss, expected, rtol=1e-6)


def test_man_refuses_a_model_that_changes_a_hooked_activation_in_place():
    class AddsInPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act, self.classifier = nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)

        def forward(self, x):
            h = self.act(self.fc(x))
            h += 1.0  # MAN's term would no longer be the post-ReLU activation
            return self.classifier(h)

    model = AddsInPlace()
    reg = make_reg(MAN, zeta=1.0, num_classes=2)
    reg.attach(model)
    with pytest.raises(ConfigError, match="in place"):  # autograd refuses the change of MAN's view
        reg.forward(make_step(model, torch.randn(3, 4), torch.tensor([0, 1, 0]), num_classes=2))
    with torch.no_grad(), pytest.raises(ConfigError, match="in place"):  # no graph: the version counter tells
        reg.capture(model, torch.randn(3, 4))


# --------------------------------------------------------------------------------------------------------- ASD
class FixedLogits(nn.Module):
    """A 'model' whose logits are a parameter (the student) or a buffer (the teacher), whatever the input."""

    def __init__(self, z, trainable):
        super().__init__()
        if trainable:
            self.z = nn.Parameter(z.clone())
        else:
            self.register_buffer("z", z.clone())

    def forward(self, x):
        return self.z


def test_asd_weights_kl_and_gradient_match_numpy():
    g = np.random.default_rng(0)
    B, C = 6, 4
    zs, zg = g.normal(size=(B, C)) * 2, g.normal(size=(B, C)) * 2
    y = np.array([0, 1, 3, 3, 0, 3])
    counts = np.array([5.0, 1.0, 0.0, 4.0])  # the client's whole data; class 2 absent
    lam, tau, bh, by = 3.0, 2.0, 0.7, 1.3
    reg = make_reg(ASD, num_classes=C, asd_lambda=lam, temperature=tau, asd_beta_entropy=bh, asd_beta=by)
    student = FixedLogits(torch.tensor(zs, dtype=torch.float64), True)
    teacher = FixedLogits(torch.tensor(zg, dtype=torch.float64), False)
    step = make_step(student, torch.zeros(B, 1), torch.tensor(y), label_counts=torch.tensor(counts), teacher=teacher)
    reg.start_cohort(step.cohort)
    loss = one_loss(reg.forward(step))
    loss.backward()

    # numpy, naively as the code writes it: softmax ratios
    def softmax(z):
        e = np.exp(z - z.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)

    qg, qk = softmax(zg / tau), softmax(zs / tau)
    kl = (qg * np.log(qg / qk)).sum(1)
    q1 = softmax(zg)
    entropy = -(q1 * np.log(q1)).sum(1)
    p = counts / counts.sum()
    w = np.exp(-bh * entropy) / p[y] ** by
    alpha = w / w.sum()
    expected = np_ce(zs, y) + lam * (alpha * kl).sum()
    assert abs(loss.item() - expected) < 1e-10
    # d/dz_k [lam sum_i alpha_i KL_i] = lam alpha_i (q_k^tau - q_g^tau) / tau; CE: (softmax - onehot) / B
    onehot = np.eye(C)[y]
    grad = (softmax(zs) - onehot) / B + lam * alpha[:, None] * (qk - qg) / tau
    assert np.abs(student.z.grad.numpy() - grad).max() < 1e-10
    # uniform ablation: plain mean of KL_i
    reg_u = make_reg(ASD, num_classes=C, asd_lambda=lam, temperature=tau, asd_uniform=True)
    reg_u.start_cohort(step.cohort)
    assert abs(one_loss(reg_u.forward(step)).item() - (np_ce(zs, y) + lam * kl.mean())) < 1e-10


def test_asd_teacher_is_the_round_model_not_the_moving_local_model():
    torch.manual_seed(4)
    model = DigitsCNN(10)
    teacher = copy.deepcopy(model).eval()
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    reg = make_reg(ASD)
    step = make_step(model, x, y, teacher=teacher)
    reg.start_cohort(step.cohort)
    model.eval()
    # at the round's start student == teacher: KL = 0, the loss is the CE
    assert torch.allclose(one_loss(reg.forward(step)), F.cross_entropy(model(x), y), atol=1e-6)
    with torch.no_grad():
        model.classifier.bias += torch.linspace(-1, 1, 10)
    assert one_loss(reg.forward(step)).item() > F.cross_entropy(model(x), y).item() + 1e-4


# ---------------------------------------------------------------------------------------------------- FedAlign
def test_fedalign_sigma_is_the_top_singular_value_of_the_transmitting_matrix():
    g = torch.Generator().manual_seed(5)
    f_prev = torch.rand(3, 6, 4, 4, generator=g, dtype=torch.float64)  # pooled to 2x2 first
    f_last = torch.rand(3, 5, 2, 2, generator=g, dtype=torch.float64)
    a = f_prev.numpy().reshape(3, 6, 2, 2, 2, 2).mean(axis=(3, 5)).reshape(3, 6, 4)  # 2x2 average pooling
    b = f_last.numpy().reshape(3, 5, 4)
    x_np = a @ b.transpose(0, 2, 1) / 4
    assert np.allclose(transmitting_matrix(f_prev, f_last).numpy(), x_np, rtol=1e-12)
    exact = np.sqrt([np.linalg.eigvalsh(m @ m.T).max() for m in x_np])
    sigma = spectral_norm(f_prev, f_last).numpy()
    assert np.allclose(sigma, exact, rtol=1e-6)  # non-negative features: a dominant eigenvalue, fast convergence
    # vectors (the dense final block): X = a b^T / 1
    va, vb = torch.randn(4, 7, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)
    xv = np.einsum("bi,bj->bij", va.numpy(), vb.numpy())
    exact_v = np.sqrt([np.linalg.eigvalsh(m @ m.T).max() for m in xv])
    assert np.allclose(spectral_norm(va, vb).numpy(), exact_v, rtol=1e-10)
    # and it is the code's 10-step estimate from the all-ones vector, not the exact value, on a slow spectrum:
    # X = A B^T / HW with A = 3 diag(d), B = I (HW = 3) is diag(d)
    d = np.array([1.0, 0.97, 0.5])
    a_map = torch.tensor(3 * np.diag(d))[None, :, :, None]  # (1, C=3, H=3, W=1)
    b_map = torch.eye(3, dtype=torch.float64)[None, :, :, None]
    assert np.allclose(transmitting_matrix(a_map, b_map)[0].numpy(), np.diag(d))
    v = np.ones(3)
    for _ in range(10):
        kv = np.diag(d ** 2) @ v
        v = kv / np.linalg.norm(kv)
    estimate = np.sqrt(np.linalg.norm(kv))
    got = float(spectral_norm(a_map, b_map)[0])
    assert abs(got - estimate) < 1e-12 and abs(got - 1.0) > 1e-3


def test_fedalign_dense_final_block_value_and_gradient_equal_closed_form():
    """digits CNN: the final block is fc1+ReLU; vector features make X rank one, so sigma = |f_prev| |f_last|."""
    torch.manual_seed(6)
    model = DigitsCNN(10)
    mu, width = 0.45, 0.25
    reg = make_reg(FedAlign, fedalign_mu=mu, width=width)
    reg.attach(model)
    x, y = torch.randn(6, 1, 8, 8), torch.tensor([0, 1, 2, 3, 4, 5])
    loss = one_loss(reg.forward(make_step(model, x, y)))
    loss.backward()
    got = grads_of(model)

    p = {n: t.detach().clone().requires_grad_(True) for n, t in model.named_parameters()}
    h = F.max_pool2d(torch.relu(F.conv2d(x, p["conv1.weight"], p["conv1.bias"], padding=1)), 2)
    f_prev = F.max_pool2d(torch.relu(F.conv2d(h, p["conv2.weight"], p["conv2.bias"], padding=1)), 2).flatten(1)
    f_last = torch.relu(F.linear(f_prev, p["fc1.weight"], p["fc1.bias"]))
    ce = F.cross_entropy(F.linear(f_last, p["classifier.weight"], p["classifier.bias"]), y)
    n_in, n_out = math.ceil(width * 128), math.ceil(width * 64)  # 32 of 128 inputs, 16 of 64 units
    s_in = f_prev.detach()[:, :n_in]
    s_out = torch.relu(F.linear(s_in, p["fc1.weight"][:n_out, :n_in], p["fc1.bias"][:n_out]))
    sigma_s = s_in.norm(dim=1) * s_out.norm(dim=1)
    sigma_t = (f_prev.norm(dim=1) * f_last.norm(dim=1)).detach()
    lip = ((sigma_s - sigma_t) ** 2).mean()
    expected = ce + mu * (ce.detach() / lip.detach()) * lip
    expected.backward()
    assert torch.allclose(loss, (1 + mu) * ce, rtol=1e-5)  # the rescaled term's value is mu * CE
    assert torch.allclose(loss, expected, rtol=1e-5)
    for (name, _), g in zip(model.named_parameters(), got):
        assert torch.allclose(g, p[name].grad, rtol=1e-4, atol=1e-7), name
    # the student reads a detached input: the convolutions get only the CE gradient
    zero_grads(model)
    F.cross_entropy(model(x), y).backward()
    assert torch.allclose(got[0], model.conv1.weight.grad, rtol=1e-5, atol=1e-8)
    assert not torch.allclose(got[4], model.fc1.weight.grad, rtol=1e-3)


def _slim_widths(model):
    return {m.width for m in model.modules() if isinstance(m, SLIMMABLE_TYPES)} | {model.width}


def test_fedalign_resnet_value_detachment_and_width_restored():
    torch.manual_seed(7)
    model = build_model("resnet20", num_classes=10, in_channels=1, image_size=8)
    mu = 0.45
    reg = make_reg(FedAlign, fedalign_mu=mu, width=0.25)
    reg.attach(model)
    x, y = torch.randn(6, 1, 8, 8), torch.tensor([0, 1, 2, 3, 4, 5])
    step = make_step(model, x, y)
    loss = one_loss(reg.forward(step))
    assert _slim_widths(model) == {1.0}  # the server model is the full network again
    assert step.logits.shape == (1, 6, 10)
    ce = F.cross_entropy(step.logits[0], y)
    assert torch.allclose(loss, (1 + mu) * ce, rtol=1e-5)
    assert step.scratch["fedalign_lip"] > 0
    loss.backward()
    got = dict((n, p.grad.clone()) for n, p in model.named_parameters())
    zero_grads(model)
    F.cross_entropy(model(x), y).backward()
    for n, p in model.named_parameters():
        if n.startswith(("stem", "layer1", "layer2", "classifier")):  # before the final block, or after it
            assert torch.allclose(got[n], p.grad, rtol=1e-4, atol=1e-7), n
    changed = [n for n, p in model.named_parameters() if n.startswith("layer3")
               and not torch.allclose(got[n], p.grad, rtol=1e-3, atol=1e-7)]
    assert changed and all(n.startswith("layer3.") for n in changed)


class Wrapped(nn.Module):
    """A network inside a wrapper with its own head (as MOON's projection-head model): classifier(head(features))."""

    def __init__(self, encoder: nn.Module, classes: int = 10):
        super().__init__()
        d = encoder.feature_dim
        encoder.classifier = nn.Identity()
        self.encoder, self.classifier = encoder, nn.Linear(d, classes)
        self.head = nn.Sequential(nn.Linear(d, d), nn.ReLU())

    def forward(self, x):
        return self.classifier(self.head[0](self.encoder.features(x)))  # the ReLU of the head is not used


def test_fedalign_finds_the_stage_inside_a_wrapper_and_survives_deep_copies():
    torch.manual_seed(12)
    model = Wrapped(build_model("resnet20", num_classes=10, in_channels=1, image_size=8))
    reg = make_reg(FedAlign, fedalign_mu=0.3)
    reg.attach(model)
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    step = make_step(model, x, y)
    loss = one_loss(reg.forward(step))
    assert step.logits.shape == (1, 4, 10)
    assert torch.allclose(loss, 1.3 * F.cross_entropy(step.logits[0], y), rtol=1e-5)
    assert step.scratch["fedalign_lip"] > 0 and _slim_widths(model.encoder) == {1.0}
    copy.deepcopy(model)(x)  # an algorithm's own copy (FedNTD's teacher): hooks shared, nothing captured
    # around a CNN the wrapper's head breaks classifier(act(linear(.))): refused with one clear line
    dense = make_reg(FedAlign)
    wrapped_cnn = Wrapped(DigitsCNN(10))
    dense.attach(wrapped_cnn)
    with pytest.raises(ConfigError, match="do not feed the classifier"):
        dense.forward(make_step(wrapped_cnn, x, y))


def test_fedalign_rejects_models_without_a_final_block():
    from fl_harness import Linear

    with pytest.raises(ConfigError, match="fedalign"):
        make_reg(FedAlign).attach(Linear(4, 3))
    make_reg(FedAlign).attach(build_model("mlp", num_classes=3, in_channels=1, image_size=2))  # has one: fine


# ----------------------------------------------------------------------------------------------------- GradAug
def test_gradaug_resolutions_widths_and_unsupported_models():
    assert resolutions(32) == [32, 28, 24, 20]  # the FedAlign code's CIFAR set
    assert resolutions(8) == [8, 7, 6, 5]
    reg = make_reg(GradAug, num_subnets=4, width=0.3)
    torch.manual_seed(0)
    w = reg.sample_widths()
    assert len(w) == 4 and w == sorted(w, reverse=True) and w[-1] == 0.3 and all(0.3 <= v <= 1 for v in w)
    with pytest.raises(ConfigError, match="slimmable"):
        reg.attach(DigitsCNN(10))


def test_gradaug_loss_is_ce_plus_kl_of_the_slimmed_resized_subnetwork():
    torch.manual_seed(8)
    model = build_model("resnet20", num_classes=10, in_channels=1, image_size=8)
    mu, width = 1.75, 0.5
    reg = make_reg(GradAug, num_subnets=1, width=width, gradaug_mu=mu)  # one sub-network: width omega
    reg.attach(model)
    x, y = torch.randn(5, 1, 8, 8), torch.tensor([0, 1, 2, 3, 4])
    step = make_step(model, x, y)
    loss = one_loss(reg.forward(step))
    assert _slim_widths(model) == {1.0}
    with torch.no_grad():
        full = model(x)
        ce = F.cross_entropy(full, y)
        pt = torch.softmax(full, 1)
        candidates = []
        model.set_width(width)
        for r in (8, 7, 6, 5):
            xr = F.interpolate(x, size=(r, r), mode="bilinear", align_corners=True)
            ps = torch.softmax(model(xr), 1)
            candidates.append(float(ce + mu * (pt * (pt.log() - ps.log())).sum(1).mean()))
        model.set_width(1.0)
    assert min(abs(loss.item() - c) for c in candidates) < 1e-5
    assert loss.item() > float(ce) + 1e-4


# ------------------------------------------------------------------------------------------------------- Mixup
def test_mixup_lambda_is_beta_distributed():
    torch.manual_seed(9)
    gamma = 0.1
    beta = beta_distribution(gamma)
    lams = np.array([sample_mix(beta, 4)[0] for _ in range(4000)])
    assert abs(lams.mean() - 0.5) < 0.03
    assert abs(lams.var() - 1 / (4 * (2 * gamma + 1))) < 0.015  # Beta(g, g): variance 1 / (4 (2g + 1))
    assert beta_distribution(0.0) is None and sample_mix(None, 5)[0] == 1.0


def test_mixup_loss_equals_hand_computation():
    from fl_harness import Linear

    torch.manual_seed(10)
    model = Linear(3, 3)
    x, y = torch.randn(6, 1, 1, 3), torch.tensor([0, 1, 2, 0, 1, 2])
    reg = make_reg(Mixup, num_classes=3, mixup_gamma=1.0)
    step = make_step(model, x, y, num_classes=3, rng_seed=10)  # the client's own stream draws lambda and pi
    loss = one_loss(reg.forward(step))
    assert step.scratch["mixup_lambda"].shape == (1,) and step.scratch["mixup_perm"].shape == (1, 6)
    lam, perm = float(step.scratch["mixup_lambda"][0]), step.scratch["mixup_perm"][0].numpy()
    W, b = model.classifier.weight.detach().double().numpy(), model.classifier.bias.detach().double().numpy()
    xn = x.reshape(6, 3).double().numpy()
    z = (lam * xn + (1 - lam) * xn[perm]) @ W.T + b
    expected = lam * np_ce(z, y.numpy()) + (1 - lam) * np_ce(z, y.numpy()[perm])
    assert 0 < lam < 1 and abs(loss.item() - expected) < 1e-5
    off = make_reg(Mixup, num_classes=3, mixup_gamma=0.0)
    assert torch.equal(one_loss(off.forward(make_step(model, x, y, num_classes=3))), F.cross_entropy(model(x), y))


# -------------------------------------------------------------------------------------------------- StochDepth
def test_stochdepth_survival_schedule_and_eval_formula():
    torch.manual_seed(11)
    model = build_model("resnet20", num_classes=10, in_channels=1, image_size=8)
    model = StochDepth.prepare_model(model, StochDepth.resolve({"survival_last": 0.5}))
    survivals = [blk.survival for blk in model.residual_blocks()]
    assert np.allclose(survivals, np.linspace(1.0, 0.5, 9))
    assert model.flatfl_spec["kwargs"]["stochastic_depth"] == 0.5
    block = model.residual_blocks()[-1]
    x = torch.randn(4, 64, 2, 2)
    block.eval()
    with torch.no_grad():
        assert torch.allclose(block(x), torch.relu(block.shortcut(x) + 0.5 * block.branch(x)), atol=1e-6)
        block.train()
        kept, dropped = torch.relu(block.shortcut(x) + block.branch(x)), torch.relu(block.shortcut(x))
        outcomes = []
        for _ in range(200):
            out = block(x)
            assert torch.allclose(out, kept, atol=1e-5) or torch.allclose(out, dropped, atol=1e-6)
            outcomes.append(torch.allclose(out, kept, atol=1e-5))
    assert 0.35 < np.mean(outcomes) < 0.65  # Bernoulli(0.5)
    with pytest.raises(ConfigError, match="residual"):
        StochDepth.prepare_model(DigitsCNN(10), StochDepth.resolve({}))
    wrapped = StochDepth.prepare_model(Wrapped(build_model("resnet20", num_classes=10, in_channels=1, image_size=8)),
                                       StochDepth.resolve({}))  # default: the paper's rho_L = 0.9
    assert [b.survival for b in wrapped.encoder.residual_blocks()][-1] == 0.9
