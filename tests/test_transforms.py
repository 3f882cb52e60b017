"""The FedDyn/MAN flip + zero-padded crop augmentation (docs/update-rules.md §0), checked against a numpy re-statement
of the per-sample recipe (flip the width axis, zero-pad by `pad`, slice an HxW window) and by hand-made pixels."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from flatfl.data.transforms import augment_flip_crop, draw_flip_crop, flip_crop


def reference(img: np.ndarray, flip: bool, dy: int, dx: int, pad: int) -> np.ndarray:
    """One (C, H, W) image the MAN way: np.flip on the width axis, zero canvas, slice."""
    c, h, w = img.shape
    if flip:
        img = np.flip(img, axis=2)
    canvas = np.zeros((c, h + 2 * pad, w + 2 * pad), dtype=img.dtype)
    canvas[:, pad:pad + h, pad:pad + w] = img
    return canvas[:, dy:dy + h, dx:dx + w]


def test_hand_made_pixels():
    x = torch.arange(1, 17, dtype=torch.float32).view(1, 1, 4, 4)  # rows [1..4], [5..8], [9..12], [13..16]
    yes, no = torch.tensor([True]), torch.tensor([False])
    one, zero, two = torch.tensor([1]), torch.tensor([0]), torch.tensor([2])
    # Flip only (pad 1, centred window).
    assert flip_crop(x, yes, one, one, pad=1)[0, 0].tolist() == [
        [4, 3, 2, 1], [8, 7, 6, 5], [12, 11, 10, 9], [16, 15, 14, 13]]
    # Crop at the top-left corner of the 1-padded image: a zero row and column come in.
    assert flip_crop(x, no, zero, zero, pad=1)[0, 0].tolist() == [
        [0, 0, 0, 0], [0, 1, 2, 3], [0, 5, 6, 7], [0, 9, 10, 11]]
    # Flip, then the bottom-right window (offset 2 = 2*pad): the flipped image shifted up-left.
    assert flip_crop(x, yes, two, two, pad=1)[0, 0].tolist() == [
        [7, 6, 5, 0], [11, 10, 9, 0], [15, 14, 13, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("pad", [1, 4])
def test_every_decision_matches_the_reference(pad):
    """All flips and offsets at once, on a non-square 2-channel image (catches swapped axes)."""
    rng = np.random.default_rng(0)
    img = rng.normal(size=(2, 5, 7)).astype(np.float32)
    decisions = [(f, dy, dx) for f in (False, True) for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)]
    batch = torch.from_numpy(np.repeat(img[None], len(decisions), axis=0))
    flip = torch.tensor([d[0] for d in decisions])
    dy = torch.tensor([d[1] for d in decisions])
    dx = torch.tensor([d[2] for d in decisions])
    out = flip_crop(batch, flip, dy, dx, pad=pad)
    assert out.shape == batch.shape and out.dtype == batch.dtype
    for k, (f, oy, ox) in enumerate(decisions):
        np.testing.assert_array_equal(out[k].numpy(), reference(img, f, oy, ox, pad))
    assert torch.equal(batch[0], torch.from_numpy(img))  # input untouched


def identify(outputs: torch.Tensor, image: np.ndarray, pad: int) -> list[tuple[bool, int, int]]:
    """Which (flip, dy, dx) produced each output, by matching against every reference candidate."""
    candidates = [(f, dy, dx) for f in (False, True) for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)]
    ref = np.stack([reference(image, *c, pad).ravel() for c in candidates]).astype(np.float64)  # (K, D)
    flat = outputs.reshape(len(outputs), -1).numpy().astype(np.float64)
    # Squared distances |a|^2 + |b|^2 - 2ab: exact here, since the pixels are small integers.
    dist = (flat ** 2).sum(1)[:, None] + (ref ** 2).sum(1)[None, :] - 2.0 * flat @ ref.T
    best = dist.argmin(1)
    assert np.all(dist[np.arange(len(flat)), best] == 0), "an output matches no flip/crop of the input"
    return [candidates[i] for i in best]


def test_statistics_of_flip_and_crop():
    pad, n = 4, 6000
    image = (np.arange(64, dtype=np.float32).reshape(1, 8, 8) + 1.0)  # distinct values: every window is unique
    g = torch.Generator().manual_seed(123)
    out = augment_flip_crop(torch.from_numpy(np.repeat(image[None], n, axis=0)), g, pad=pad)
    found = identify(out, image, pad)
    flips = np.array([f for f, _, _ in found])
    offsets = np.array([(dy, dx) for _, dy, dx in found])
    # Flip: Bernoulli(1/2).
    assert abs(flips.mean() - 0.5) < 4 * np.sqrt(0.25 / n)
    # Offsets: (pad, pad) with prob 1/2 (no crop) + 1/2 * 1/81; each of the other 80 with prob 1/2 * 1/81.
    side = 2 * pad + 1
    counts = np.bincount(offsets[:, 0] * side + offsets[:, 1], minlength=side * side)
    probs = np.full(side * side, 0.5 / side ** 2)
    probs[pad * side + pad] += 0.5
    assert chisquare(counts, probs * n).pvalue > 1e-3
    # Flip and crop are independent: the flip rate is the same among shifted and unshifted samples.
    shifted = (offsets != pad).any(1)
    assert abs(flips[shifted].mean() - flips[~shifted].mean()) < 0.06


def test_deterministic_per_seed_and_draws_advance():
    x = torch.randn(64, 3, 16, 16)
    a = augment_flip_crop(x, torch.Generator().manual_seed(7))
    b = augment_flip_crop(x, torch.Generator().manual_seed(7))
    c = augment_flip_crop(x, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    g = torch.Generator().manual_seed(7)
    first, second = augment_flip_crop(x, g), augment_flip_crop(x, g)
    assert torch.equal(first, a) and not torch.equal(first, second)
    # augment = draw decisions, then apply them.
    g = torch.Generator().manual_seed(7)
    assert torch.equal(flip_crop(x, *draw_flip_crop(64, g)), a)


def test_zero_padding_is_applied_to_the_normalised_values():
    """The border is exactly 0.0 (the mean colour after normalisation), not -mean/std (black)."""
    x = torch.full((1, 3, 8, 8), -2.0)
    out = flip_crop(x, torch.tensor([False]), torch.tensor([0]), torch.tensor([8]), pad=4)
    assert torch.all(out[0, :, :4, :] == 0.0) and torch.all(out[0, :, :, 4:] == 0.0)
    assert torch.all(out[0, :, 4:, :4] == -2.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batch_matches_cpu():
    x = torch.randn(32, 3, 32, 32)
    cpu = augment_flip_crop(x, torch.Generator().manual_seed(3))
    gpu = augment_flip_crop(x.cuda(), torch.Generator().manual_seed(3))  # CPU draws, CUDA gather
    assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)
    on_device = augment_flip_crop(x.cuda(), torch.Generator(device="cuda").manual_seed(3))
    assert on_device.device.type == "cuda" and on_device.shape == x.shape
