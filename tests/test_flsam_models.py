"""FL-SAM's two CIFAR-10 networks as flatfl models (harrylee999/FL-SAM, the models of its seconds-a-round table):
``flsam-cnn`` (its ``FedAvgNetCIFAR``) and ``resnet18`` with ``stem="imagenet", norm="gn"`` (its ``resnet18``:
torchvision's layout, every norm GroupNorm(2, C), no biases in the convolutions). Each is checked against a forward
pass written here from the architecture's description with torch.nn.functional, on the model's own weights, and
against its parameter count from layer arithmetic."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flatfl.models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def images(b: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def flsam_cnn_forward(w: dict, x: torch.Tensor) -> torch.Tensor:
    """FedAvgNetCIFAR: conv5x5 3->32 pad 2, ReLU, pool 2; conv5x5 32->64 pad 2, ReLU, pool 2; FC 4096->512, ReLU;
    FC 512->C."""
    x = F.max_pool2d(F.relu(F.conv2d(x, w["conv1.weight"], w["conv1.bias"], padding=2)), 2, 2)
    x = F.max_pool2d(F.relu(F.conv2d(x, w["conv2.weight"], w["conv2.bias"], padding=2)), 2, 2)
    x = F.relu(F.linear(x.reshape(x.shape[0], -1), w["fc1.weight"], w["fc1.bias"]))
    return F.linear(x, w["classifier.weight"], w["classifier.bias"])


def test_flsam_cnn_is_fl_sams_cnn():
    torch.manual_seed(0)
    model = build_model("flsam-cnn", num_classes=10, in_channels=3, image_size=32).double().eval()
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes == [(32, 3, 5, 5), (32,), (64, 32, 5, 5), (64,), (512, 4096), (512,), (10, 512), (10,)]
    assert n_params(model) == (3 * 32 * 25 + 32) + (32 * 64 * 25 + 64) + (4096 * 512 + 512) + (512 * 10 + 10) \
        == 2_156_490
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x), flsam_cnn_forward(dict(model.named_parameters()), x),
                                   rtol=1e-12, atol=1e-12)
    assert len(model.activation_modules()) == 3


def resnet18_gn_forward(w: dict, x: torch.Tensor) -> torch.Tensor:
    """torchvision's ResNet-18 (BasicBlocks [2, 2, 2, 2], widths 64-512) with GroupNorm(2, C) for every norm, as
    FL-SAM's ``resnet18``: conv7x7/2 pad 3, GN, ReLU, max-pool 3/2 pad 1; in each block conv3x3 (stride 2 in the
    first block of stages 2-4), GN, ReLU, conv3x3, GN, plus the shortcut (a 1x1/2 conv + GN where the shape changes),
    ReLU; global average pooling; FC."""
    def gn(t, name):
        return F.group_norm(t, 2, w[f"{name}.weight"], w[f"{name}.bias"], eps=1e-5)

    x = F.relu(gn(F.conv2d(x, w["stem_conv.weight"], stride=2, padding=3), "stem_norm"))
    x = F.max_pool2d(x, 3, 2, 1)
    for stage in range(1, 5):
        for block in range(2):
            p = f"layer{stage}.{block}"
            stride = 2 if stage > 1 and block == 0 else 1
            out = F.relu(gn(F.conv2d(x, w[f"{p}.conv1.weight"], stride=stride, padding=1), f"{p}.norm1"))
            out = gn(F.conv2d(out, w[f"{p}.conv2.weight"], padding=1), f"{p}.norm2")
            shortcut = x
            if f"{p}.shortcut.0.weight" in w:
                shortcut = gn(F.conv2d(x, w[f"{p}.shortcut.0.weight"], stride=stride), f"{p}.shortcut.1")
            x = F.relu(out + shortcut)
    x = x.mean(dim=(2, 3))
    return F.linear(x, w["classifier.weight"], w["classifier.bias"])


def test_resnet18_with_the_imagenet_stem_and_groupnorm_is_fl_sams_resnet18():
    torch.manual_seed(0)
    model = build_model("resnet18", num_classes=10, in_channels=3, image_size=32, stem="imagenet",
                        norm="gn").double().eval()
    with torch.no_grad():  # norms away from their unit / zero start, so that the affine terms are checked too
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "norm" in name or "shortcut.1" in name:
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))

    def conv(c_in, c_out, k):
        return c_in * c_out * k * k

    def block(c_in, c_out, projection):
        return conv(c_in, c_out, 3) + conv(c_out, c_out, 3) + 4 * c_out + (conv(c_in, c_out, 1) + 2 * c_out
                                                                           if projection else 0)

    stages = [(64, 64, False), (64, 128, True), (128, 256, True), (256, 512, True)]
    expected = conv(3, 64, 7) + 2 * 64 + sum(block(i, o, pr) + block(o, o, False) for i, o, pr in stages) \
        + 512 * 10 + 10
    assert n_params(model) == expected == 11_181_642
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x), resnet18_gn_forward(dict(model.named_parameters()), x),
                                   rtol=1e-10, atol=1e-10)


def test_flsam_cnn_narrower_widths_keep_its_structure_and_bad_ones_are_one_line():
    from flatfl.errors import ConfigError

    slim = build_model("flsam-cnn", 10, 3, 32, channels=[4, 8], hidden=16)
    # conv 3->4 (5x5), conv 4->8 (5x5), FC 8*8*8 -> 16, FC 16 -> 10: counted by hand
    hand = (3 * 4 * 25 + 4) + (4 * 8 * 25 + 8) + (512 * 16 + 16) + (16 * 10 + 10)
    assert sum(p.numel() for p in slim.parameters()) == hand
    full = build_model("flsam-cnn", 10, 3, 32)
    assert [type(m).__name__ for m in slim.children()] == [type(m).__name__ for m in full.children()]
    for bad in ({"channels": [4]}, {"channels": [0, 8]}, {"hidden": [16, 8]}, {"hidden": 0}, {"hidden": True}):
        with pytest.raises(ConfigError, match="flsam-cnn"):
            build_model("flsam-cnn", 10, 3, 32, **bad)
