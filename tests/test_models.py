"""Tests for flatfl.models: shapes, parameter counts from layer arithmetic, the features/classifier contract, MAN
activation hooks, slimming against explicitly built narrow networks, stochastic depth, specs and errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn as nn

from flatfl.errors import ConfigError
from flatfl.models import build_model, model_names, set_stochastic_depth
from flatfl.models.resnet import BasicBlock, Bottleneck, ResNet

# name -> (in_channels, image_size, num_classes) of the model's natural input
NATURAL = {
    "cifar-cnn": (3, 32, 100),
    "tiny-cnn": (3, 64, 200),
    "emnist-cnn": (1, 28, 62),
    "flsam-cnn": (3, 32, 10),
    "digits-cnn": (1, 8, 10),
    "tiny": (1, 8, 10),
    "mlp": (1, 8, 10),
    "resnet20": (3, 32, 10),
    "resnet56": (3, 32, 100),
    "resnet18": (3, 32, 10),
}
FEATURE_DIM = {"cifar-cnn": 192, "tiny-cnn": 384, "emnist-cnn": 2048, "flsam-cnn": 512, "digits-cnn": 64, "tiny": 32,
               "mlp": 64, "resnet20": 64, "resnet56": 256, "resnet18": 512}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def conv(c_in, c_out, k, bias=True):
    return c_in * c_out * k * k + (c_out if bias else 0)


def fc(d_in, d_out):
    return d_in * d_out + d_out


def build(name, num_classes=None, seed=0, **kwargs):
    c, s, k = NATURAL[name]
    torch.manual_seed(seed)
    return build_model(name, num_classes or k, c, s, **kwargs)


def batch(name, b=2, seed=1, small=False):
    """A random batch of the model's natural input; ``small`` gives ResNets 8x8 inputs (they take any size), which
    keeps their tests fast: on CPU every new input shape costs a one-off convolution warm-up."""
    c, s, _ = NATURAL[name]
    if small and name.startswith("resnet"):
        s = 8
    return torch.randn(b, c, s, s, generator=torch.Generator().manual_seed(seed))


def copy_sliced(source: nn.Module, target: nn.Module) -> None:
    """Fill every tensor of ``target`` with the leading slice of the same-named tensor of ``source``."""
    src = source.state_dict()
    with torch.no_grad():
        for key, value in target.state_dict().items():
            value.copy_(src[key][tuple(slice(0, n) for n in value.shape)])


def randomise_norm_stats(model: nn.Module, seed: int = 5) -> None:
    """Give every BatchNorm non-trivial affine parameters and running statistics (so slicing them matters)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=gen))
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(0.2 * torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))


# ---------------------------------------------------------------- registry, shapes, contract

def test_model_names_lists_every_model():
    assert model_names() == sorted(NATURAL)


@pytest.mark.parametrize("name", sorted(NATURAL))
def test_shapes_and_features_classifier_contract(name):
    model = build(name).eval()
    x = batch(name)
    _, _, k = NATURAL[name]
    with torch.no_grad():
        logits = model(x)
        feats = model.features(x)
        assert logits.shape == (2, k)
        assert feats.shape == (2, FEATURE_DIM[name]) and model.feature_dim == FEATURE_DIM[name]
        assert isinstance(model.classifier, nn.Linear) and model.classifier.out_features == k
        torch.testing.assert_close(logits, model.classifier(feats), rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(NATURAL))
def test_any_number_of_classes_and_spec_rebuild(name):
    model = build(name, num_classes=7)
    assert model(batch(name, small=True)).shape == (2, 7)
    spec = json.loads(json.dumps(model.flatfl_spec))  # checkpoints store the spec as JSON
    assert spec["name"] == name and spec["kwargs"]["num_classes"] == 7
    rebuilt = build_model(spec["name"], **spec["kwargs"])
    assert [(n, p.shape) for n, p in rebuilt.named_parameters()] == [(n, p.shape) for n, p in model.named_parameters()]


def test_initialisation_is_deterministic_given_the_global_seed():
    a, b, c = build("resnet20", seed=3), build("resnet20", seed=3), build("resnet20", seed=4)
    for (pa, pb, pc) in zip(a.parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb)
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()) if pa.dim() > 1)


def test_spec_records_options_and_rebuilds_them():
    torch.manual_seed(0)
    mlp = build_model("mlp", 5, 2, 6, hidden=[16, 8])
    assert [m.out_features for m in mlp.modules() if isinstance(m, nn.Linear)] == [16, 8, 5]
    assert len(mlp.activation_modules()) == 2
    assert n_params(mlp) == fc(72, 16) + fc(16, 8) + fc(8, 5)
    again = build_model(**{"name": "mlp"}, **json.loads(json.dumps(mlp.flatfl_spec["kwargs"])))
    assert n_params(again) == n_params(mlp)
    torch.manual_seed(0)
    gn = build_model("resnet18", 10, 3, 32, norm="gn")
    assert gn.flatfl_spec["kwargs"]["norm"] == "gn"
    assert all(m.num_groups == 2 for m in gn.modules() if isinstance(m, nn.GroupNorm))
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gn.modules())


# ---------------------------------------------------------------- parameter counts from layer arithmetic

@pytest.mark.parametrize("classes", [100, 10])
def test_cifar_cnn_parameter_count(classes):
    expected = conv(3, 64, 5) + conv(64, 64, 5) + fc(64 * 5 * 5, 384) + fc(384, 192) + fc(192, classes)
    assert n_params(build("cifar-cnn", num_classes=classes)) == expected
    if classes == 100:
        assert expected == 815_332  # docs/update-rules.md §20


def test_cifar_cnn_at_lenet_widths_on_fashion_mnist():
    """The fmnist-cnn preset's network: the MAN CNN with 6/16 channels and 120/84 hidden units on 1x28x28
    (28 -> conv 24 -> pool 12 -> conv 8 -> pool 4: 16 * 4 * 4 = 256 inputs to fc1)."""
    torch.manual_seed(0)
    model = build_model("cifar-cnn", 10, 1, 28, channels=[6, 16], hidden=[120, 84])
    expected = conv(1, 6, 5) + conv(6, 16, 5) + fc(16 * 4 * 4, 120) + fc(120, 84) + fc(84, 10)
    assert n_params(model) == expected == 44_426
    assert model.feature_dim == 84 and model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert model.activation_modules() == [model.relu1, model.relu2, model.relu3, model.relu4]
    again = build_model(model.flatfl_spec["name"], **model.flatfl_spec["kwargs"])
    assert [p.shape for p in again.parameters()] == [p.shape for p in model.parameters()]


def test_tiny_cnn_emnist_digits_tiny_parameter_counts():
    tiny_cnn = conv(3, 64, 3) + 3 * 2 * 64 + 2 * conv(64, 64, 3) + fc(4096, 512) + fc(512, 384) + fc(384, 200)
    assert n_params(build("tiny-cnn")) == tiny_cnn  # MAN supp. Table 4: FC(4096, 512) on 64x64 inputs
    leaf = conv(1, 32, 5) + conv(32, 64, 5) + fc(7 * 7 * 64, 2048) + fc(2048, 62)
    assert n_params(build("emnist-cnn")) == leaf
    digits = conv(1, 16, 3) + conv(16, 32, 3) + fc(32 * 2 * 2, 64) + fc(64, 10)
    assert n_params(build("digits-cnn")) == digits == 13_706
    assert 10_000 <= digits <= 20_000
    assert n_params(build("tiny")) == fc(64, 32) + fc(32, 10) <= 5_000


def _resnet_count(block, blocks, widths, classes, stem=16):
    """Parameter count of a CIFAR ResNet with BatchNorm (2 parameters per channel) and 1x1 projections."""
    expansion = 4 if block == "bottleneck" else 1
    total = conv(3, stem, 3, bias=False) + 2 * stem
    c_in = stem
    for stage, (count, planes) in enumerate(zip(blocks, widths)):
        for b in range(count):
            c_out = planes * expansion
            if block == "basic":
                total += conv(c_in, planes, 3, False) + conv(planes, planes, 3, False) + 4 * planes
            else:
                total += (conv(c_in, planes, 1, False) + conv(planes, planes, 3, False)
                          + conv(planes, c_out, 1, False) + 4 * planes + 2 * c_out)
            if (stage > 0 and b == 0) or c_in != c_out:
                total += conv(c_in, c_out, 1, False) + 2 * c_out
            c_in = c_out
    return total + fc(c_in, classes)


def test_resnet_parameter_counts():
    r56 = n_params(build("resnet56"))
    assert r56 == _resnet_count("bottleneck", (6, 6, 6), (16, 32, 64), 100)
    assert round(r56 / 1e6, 2) == 0.61  # FedAlign Table 5: FedAvg ResNet-56 on CIFAR-100 stores 0.61M parameters
    assert n_params(build("resnet20")) == _resnet_count("basic", (3, 3, 3), (16, 32, 64), 10)
    assert n_params(build("resnet18")) == _resnet_count("basic", (2, 2, 2, 2), (64, 128, 256, 512), 10, stem=64)


@pytest.mark.parametrize("name,block,blocks,widths", [("resnet20", "basic", (3, 3, 3), (4, 8, 8)),
                                                      ("resnet56", "bottleneck", (6, 6, 6), (4, 8, 8)),
                                                      ("resnet18", "basic", (2, 2, 2, 2), (4, 8, 8, 8))])
def test_resnet_widths_build_the_same_structure_with_those_channels(name, block, blocks, widths):
    """``widths`` (one per stage; what the differential cases train): the stem and every block at those widths, the
    blocks, strides and projection shortcuts of the default network, recorded in the spec and rebuilt from it."""
    model = build(name, widths=list(widths))
    expansion = 4 if block == "bottleneck" else 1
    assert model.stem_conv.out_channels == widths[0]
    for stage, width, count in zip(model.stages(), widths, blocks):
        assert len(stage) == count and all(b.conv1.out_channels == width for b in stage)
        assert all(b.norm1.num_features == width for b in stage)
    assert model.feature_dim == widths[-1] * expansion
    assert n_params(model) == _resnet_count(block, blocks, widths, NATURAL[name][2], stem=widths[0])
    default = build(name)
    assert [type(b.shortcut) for b in model.residual_blocks()] == [type(b.shortcut) for b in default.residual_blocks()]
    assert [b.conv1.stride for b in model.residual_blocks()] == [b.conv1.stride for b in default.residual_blocks()]
    assert model.flatfl_spec["kwargs"]["widths"] == list(widths)
    again = build_model(name, **json.loads(json.dumps(model.flatfl_spec["kwargs"])))
    assert [p.shape for p in again.parameters()] == [p.shape for p in model.parameters()]
    assert model(batch(name, small=True)).shape == (2, NATURAL[name][2])


def test_resnet_widths_refused_in_one_line():
    for bad in ((16, 32), (16, 32, 64, 128), (16, 0, 64), (16.0, 32, 64), (True, 32, 64), "16,32,64", 16, None):
        with pytest.raises(ConfigError, match=r"model 'resnet20': widths must be 3 positive ints \(one per stage\)") \
                as info:
            build_model("resnet20", 10, 3, 32, widths=bad)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="widths must be 4 positive ints") as info:
        build_model("resnet18", 10, 3, 32, widths=[4, 8, 8])
    with pytest.raises(ConfigError, match="GroupNorm with 2 groups does not divide") as info:
        build_model("resnet56", 10, 3, 32, norm="gn", widths=[3, 8, 8])
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- MAN activations

def capture(model, x):
    outputs = []
    handles = [m.register_forward_hook(lambda mod, inp, out: outputs.append(out)) for m in model.activation_modules()]
    try:
        logits = model(x)
    finally:
        for h in handles:
            h.remove()
    return outputs, logits


def test_cifar_cnn_activation_hooks_capture_the_four_man_terms():
    model = build("cifar-cnn").eval()
    x = batch("cifar-cnn", b=3)
    acts, _ = capture(model, x)
    assert [tuple(a.shape) for a in acts] == [(3, 64, 28, 28), (3, 64, 10, 10), (3, 384), (3, 192)]
    with torch.no_grad():  # the hooked tensors are the post-ReLU, pre-pool activations (docs/update-rules.md §16)
        a1 = torch.relu(model.conv1(x))
        a2 = torch.relu(model.conv2(nn.functional.max_pool2d(a1, 2)))
        a3 = torch.relu(model.fc1(nn.functional.max_pool2d(a2, 2).flatten(1)))
        a4 = torch.relu(model.fc2(a3))
    for got, want in zip(acts, [a1, a2, a3, a4]):
        torch.testing.assert_close(got, want)


def test_tiny_cnn_activations_follow_man_code_sam():
    model = build("tiny-cnn").eval()
    acts, _ = capture(model, batch("tiny-cnn", b=1))
    assert [tuple(a.shape) for a in acts] == [(1, 64, 64, 64), (1, 64, 32, 32), (1, 64, 8, 8), (1, 512), (1, 384)]
    assert model.activation_modules()[2] is model.pool3  # conv3's term is taken after pooling


@pytest.mark.parametrize("name", sorted(NATURAL))
def test_each_activation_module_fires_once_and_is_not_the_logits(name):
    model = build(name).eval()
    modules = model.activation_modules()
    assert len({id(m) for m in modules}) == len(modules) >= 1
    acts, logits = capture(model, batch(name, small=True))
    assert len(acts) == len(modules)
    assert all(a is not logits for a in acts)
    expected = {"resnet20": 9, "resnet56": 18, "resnet18": 8}  # one output ReLU per residual block
    if name in expected:
        assert len(modules) == expected[name]


# ---------------------------------------------------------------- slimming

def test_set_width_quarter_equals_an_explicitly_built_narrow_resnet20():
    full = build("resnet20")
    randomise_norm_stats(full)
    narrow = ResNet("basic", (3, 3, 3), (4, 8, 16), num_classes=10, stem_width=4)
    copy_sliced(full, narrow)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    full.set_width(0.25)
    for mode in ("eval", "train"):
        getattr(full, mode)(), getattr(narrow, mode)()
        torch.testing.assert_close(full(x), narrow(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(full.features(x), narrow.features(x), rtol=1e-5, atol=1e-5)


def test_slim_training_leaves_running_stats_and_full_width_restores_exactly():
    model = build("resnet20").eval()
    randomise_norm_stats(model)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(x)
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    model.set_width(0.25)
    loss = model(x).logsumexp(1).sum()
    loss.backward()
    # only the leading slices receive gradient: stem conv (16 out) -> 4, classifier input 64 -> 16
    assert model.stem_conv.weight.grad[4:].abs().sum() == 0 and model.stem_conv.weight.grad[:4].abs().sum() > 0
    assert model.classifier.weight.grad[:, 16:].abs().sum() == 0
    for key, value in model.state_dict().items():  # a narrow network never touches the running statistics
        assert torch.equal(value, stats[key]), key
    model.set_width(1.0)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_bottleneck_and_groupnorm_slimming_match_narrow_networks():
    torch.manual_seed(0)
    full = ResNet("bottleneck", (2, 1, 1), (16, 32, 64), num_classes=5)
    randomise_norm_stats(full)
    narrow = ResNet("bottleneck", (2, 1, 1), (8, 16, 32), num_classes=5, stem_width=8)
    copy_sliced(full, narrow)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(4))
    full.set_width(0.5)
    full.eval(), narrow.eval()
    torch.testing.assert_close(full(x), narrow(x), rtol=1e-5, atol=1e-5)

    torch.manual_seed(0)
    gn_full = ResNet("basic", (1, 1), (8, 16), num_classes=3, norm="gn", gn_groups=2)
    randomise_norm_stats(gn_full)
    gn_narrow = ResNet("basic", (1, 1), (4, 8), num_classes=3, stem_width=4, norm="gn", gn_groups=2)
    copy_sliced(gn_full, gn_narrow)
    gn_full.set_width(0.5)
    torch.testing.assert_close(gn_full(x), gn_narrow(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="groups"):
        gn_full.set_width(0.1)  # 1 of 8 channels cannot form 2 groups
    assert gn_full.stem_norm.width == 0.5  # a refused width leaves the network as it was


def test_forward_stages_and_last_stage_rerun_for_fedalign():
    model = build("resnet56").eval()
    x = batch("resnet56")
    with torch.no_grad():
        f_prev, f_last, logits = model.forward_stages(x)
        assert f_prev.shape == (2, 128, 16, 16) and f_last.shape == (2, 256, 8, 8)
        torch.testing.assert_close(logits, model(x), rtol=0, atol=0)
        model.set_width(0.25, stages="last")
        assert model.last_stage_in_channels == 32 and model.stem_conv.width == 1.0
        s_last = model.forward_last_stage(f_prev)  # the stage reads the first 32 channels itself
        torch.testing.assert_close(s_last, model.forward_last_stage(f_prev[:, :32]), rtol=0, atol=0)
        assert s_last.shape == (2, 64, 8, 8)
        s_prev, s_last2, s_logits = model.forward_stages(x)  # earlier stages stay at full width
        torch.testing.assert_close(s_prev, f_prev, rtol=0, atol=0)
        torch.testing.assert_close(s_last2, s_last, rtol=0, atol=0)
        assert s_logits.shape == (2, 100)


def test_last_stage_at_quarter_width_equals_a_hand_built_narrow_stage():
    model = build("resnet20").eval()
    randomise_norm_stats(model)
    narrow = nn.Sequential(BasicBlock(8, 16, 2, "bn", 2), BasicBlock(16, 16, 1, "bn", 2),
                           BasicBlock(16, 16, 1, "bn", 2)).eval()
    copy_sliced(model.layer3, narrow)
    f_prev = torch.randn(2, 32, 8, 8, generator=torch.Generator().manual_seed(6))
    model.set_width(0.25, stages="last")
    with torch.no_grad():
        torch.testing.assert_close(model.forward_last_stage(f_prev.detach()), narrow(f_prev[:, :8]))
    with pytest.raises(ValueError):
        model.forward_last_stage(f_prev[:, :4])


# ---------------------------------------------------------------- stochastic depth

def test_stochastic_depth_eval_formula_by_hand():
    torch.manual_seed(0)
    block = Bottleneck(8, 4, 2, "bn", 2)
    randomise_norm_stats(block)
    block.survival = 0.7
    block.eval()
    x = torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        h = torch.relu(block.norm1(block.conv1(x)))
        h = torch.relu(block.norm2(block.conv2(h)))
        branch = block.norm3(block.conv3(h))
        identity = block.shortcut[1](block.shortcut[0](x))
        torch.testing.assert_close(block(x), torch.relu(identity + 0.7 * branch))


def test_stochastic_depth_training_draws_one_gate_per_block():
    torch.manual_seed(0)
    block = BasicBlock(4, 4, 1, "bn", 2)
    block.survival = 0.5
    x = torch.randn(4, 4, 5, 5, generator=torch.Generator().manual_seed(8))
    dropped = torch.relu(x)  # identity shortcut only
    with torch.no_grad():
        kept = torch.relu(x + block.branch(x))
    torch.manual_seed(123)
    outcomes = []
    with torch.no_grad():
        for _ in range(120):
            out = block(x)
            is_dropped, is_kept = torch.equal(out, dropped), torch.allclose(out, kept)
            assert is_dropped != is_kept  # the whole batch keeps or drops the branch together
            outcomes.append(is_kept)
    assert 0.33 < np.mean(outcomes) < 0.67  # Bernoulli(0.5): 120 draws, 3.7 standard deviations either side
    torch.manual_seed(123)
    with torch.no_grad():
        assert [torch.allclose(block(x), kept) for _ in range(30)] == outcomes[:30]  # reproducible from the seed


def test_set_stochastic_depth_is_linear_and_recorded_in_the_spec():
    model = build("resnet20")
    survivals = set_stochastic_depth(model, last=0.5)
    np.testing.assert_allclose(survivals, np.linspace(1.0, 0.5, 9))
    assert [b.survival for b in model.residual_blocks()] == survivals
    assert model.flatfl_spec["kwargs"]["stochastic_depth"] == 0.5
    rebuilt = build_model(**{"name": "resnet20"}, **model.flatfl_spec["kwargs"])
    assert [b.survival for b in rebuilt.residual_blocks()] == survivals
    with pytest.raises(ConfigError):
        set_stochastic_depth(model, last=0.0)
    with pytest.raises(ConfigError):
        set_stochastic_depth(build("cifar-cnn"), last=0.5)


# ---------------------------------------------------------------- errors

def test_config_errors_are_one_clear_line():
    with pytest.raises(ConfigError) as info:
        build_model("vgg16", 10, 3, 32)
    message = str(info.value)
    assert "vgg16" in message and "cifar-cnn" in message and "resnet56" in message and "\n" not in message
    with pytest.raises(ConfigError, match="8x8"):
        build_model("cifar-cnn", 10, 3, 8)
    with pytest.raises(ConfigError, match="does not accept"):
        build_model("cifar-cnn", 10, 3, 32, depth=3)
    for bad in (3, [120], [120, 0], [6.0, 16], "6,16", [True, 16]):
        with pytest.raises(ConfigError, match="must be two positive ints"):
            build_model("cifar-cnn", 10, 3, 32, hidden=bad)
        with pytest.raises(ConfigError, match="must be two positive ints"):
            build_model("cifar-cnn", 10, 3, 32, channels=bad)
    with pytest.raises(ConfigError, match="num_classes"):
        build_model("mlp", 0, 1, 8)
    with pytest.raises(ConfigError, match="norm"):
        build_model("resnet18", 10, 3, 32, norm="ln")
    with pytest.raises(ConfigError, match="hidden"):
        build_model("mlp", 10, 1, 8, hidden=[4, -1])
    model = build("resnet20")
    for bad in (0.0, 1.5, "wide"):
        with pytest.raises(ConfigError):
            model.set_width(bad)
    with pytest.raises(ConfigError, match="stages"):
        model.set_width(0.5, stages="middle")
