"""Sub-networks on a canvas (flatfl.models.canvas): every slot of one pass is its client's slimmed network on its
resized images.

The truths are independent of the canvas code: torch's ``F.interpolate`` for the resizing, and each client's own
network, slimmed by ``set_width`` and run on its resized batch alone, for outputs and gradients. float64, so that a
difference of summation order (1e-13) cannot hide a wrong statistic or mask (1e-3 and more).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from flatfl.models import build_model
from flatfl.models.canvas import Canvas, canvas_refusal, interpolation_matrix
from flatfl.models.params import ParamLayout
from flatfl.models.stacking import StackedLayout, stack_inputs, stack_network, unstack_outputs
from flatfl.train.regularizers.gradaug import resolutions


pytestmark = pytest.mark.usefixtures("float64_default")  # tests/conftest.py


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("size,out", [(8, 5), (8, 7), (8, 8), (32, 20), (32, 28), (13, 1), (5, 9)])
def test_interpolation_matrix_is_torchs_bilinear_resize(size, out):
    x = torch.randn(2, 3, size, size, dtype=torch.float64)
    p = interpolation_matrix(size, out)
    ref = F.interpolate(x, size=(out, out), mode="bilinear", align_corners=True)
    assert (p @ x @ p.T - ref).abs().max() < 1e-13
    if out == size:
        assert torch.equal(p, torch.eye(size, dtype=torch.float64))


def stacked_clients(name, size, channels, m=3, **kwargs):
    torch.manual_seed(0)
    base = build_model(name, num_classes=10, in_channels=channels, image_size=size, **kwargs)
    models = [copy.deepcopy(base) for _ in range(m)]
    for k, model in enumerate(models):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * (k + 1) * torch.randn_like(p))
    stacked = stack_network(base, m)
    layout = StackedLayout(stacked, m, ParamLayout(base))
    layout.set(torch.stack([ParamLayout(model).get() for model in models]))
    return models, stacked.train(), layout


@pytest.mark.parametrize("name,size,channels,kwargs", [("resnet20", 8, 1, {}), ("resnet20", 32, 3, {}),
                                                       ("resnet18", 16, 3, {"stem": "imagenet"})])
def test_each_slot_is_its_clients_slimmed_network_on_its_resized_images(name, size, channels, kwargs):
    models, stacked, layout = stacked_clients(name, size, channels, **kwargs)
    m, sizes = len(models), resolutions(size)
    canvas = Canvas(stacked, size, sizes)
    x = torch.randn(m, 4, channels, size, size, dtype=torch.float64)
    # two sub-networks per client: widths and input sizes differ between slots; a full-size slot too
    widths = [0.8, 0.9, 0.99, 0.55, 0.8, 0.62]  # 0.99: every channel, as a slimmed layer (no statistics move)
    picks = [1, 3, 0, 2, 2, 3]
    stats = [b.clone() for b in layout.buffers]
    with canvas.slots(x, widths, picks) as inputs:
        out = unstack_outputs(stacked(stack_inputs(inputs)), 2 * m)
    assert all(torch.equal(a, b) for a, b in zip(stats, layout.buffers))  # running statistics untouched
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    mine = layout.grads(touch=False)
    for k, model in enumerate(models):
        model.train()
        loss = 0.0
        for t in range(2):
            j = t * m + k
            r = sizes[picks[j]]
            xr = F.interpolate(x[k], size=(r, r), mode="bilinear", align_corners=True)
            model.set_width(widths[j], stages="all")
            ref = model(xr)
            model.set_width(1.0)
            assert rel(out[j].detach(), ref.detach()) < 1e-11, (k, t)
            loss = loss + (ref * weights[j]).sum()
        loss.backward()
        grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                           for p in ParamLayout(model).params])
        assert rel(torch.cat([g[k].reshape(-1) for g in mine]), grads) < 1e-10, k
    # the pass is over: the stacked network is the clients' full networks again
    plain = unstack_outputs(stacked.eval()(stack_inputs(x)), m)
    for k, model in enumerate(models):
        assert rel(plain[k].detach(), model.eval()(x[k]).detach()) < 1e-12


def test_a_canvas_names_what_it_cannot_run():
    assert canvas_refusal(build_model("resnet20", num_classes=10, in_channels=1, image_size=8)) is None
    gn = build_model("resnet18", num_classes=10, in_channels=1, image_size=8, norm="gn")
    assert "GroupNorm" in canvas_refusal(gn)
    assert "not one of flatfl's ResNets" in canvas_refusal(build_model("digits-cnn", num_classes=10, in_channels=1,
                                                                       image_size=8))
    with pytest.raises(ValueError, match="GroupNorm"):
        Canvas(stack_network(gn, 2), 8, [8, 6])
    _, stacked, _ = stacked_clients("resnet20", 8, 1, m=2)
    with pytest.raises(ValueError, match="must lie in"):
        Canvas(stacked, 8, [8, 9])
    canvas = Canvas(stacked, 8, [8, 6])
    x = torch.zeros(2, 3, 1, 8, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="3 widths and 3 input sizes for 2 clients"):
        with canvas.slots(x, [0.5, 0.6, 0.7], [0, 1, 1]):
            pass
    with pytest.raises(ValueError, match="got images of"):
        with canvas.slots(torch.zeros(2, 3, 1, 6, 6, dtype=torch.float64), [0.5, 0.6], [0, 1]):
            pass
