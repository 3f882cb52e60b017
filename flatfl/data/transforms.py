"""The training augmentation of the FedDyn-family code (docs/update-rules.md §0), vectorised over a batch.

Per sample, on the already-normalised float image: a horizontal flip with probability 1/2, then with probability
1/2 a random HxW crop out of the image zero-padded by ``pad`` pixels on every side (offsets uniform in
0..2*pad along each axis). The zero padding is applied to the normalised tensor, as in MAN's
``code/utils_dataset.py`` ``Dataset.__getitem__``, so the border is the per-channel mean colour rather than black.

Both steps are one index computation: flip-then-crop with offsets (dy, dx) reads padded row ``dy + i`` and padded column
``dx + j`` (or ``W + 2*pad - 1 - dx - j`` when flipped, since flipping commutes with symmetric padding). A sample
that is not cropped reads with offsets (pad, pad), i.e. the image itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def flip_crop(x: torch.Tensor, flip: torch.Tensor, offset_y: torch.Tensor, offset_x: torch.Tensor,
              pad: int = 4) -> torch.Tensor:
    """Apply given per-sample decisions: flip (bool, B), then crop at (offset_y, offset_x) of the padded image.

    Offsets are in 0..2*pad; (pad, pad) leaves the (possibly flipped) image unshifted. Returns a new tensor.
    """
    if x.dim() != 4:
        raise ValueError(f"expected a batch (B, C, H, W), got shape {tuple(x.shape)}")
    b, c, h, w = x.shape
    dev = x.device
    flip = flip.to(dev, torch.bool).view(b, 1)
    offset_y = offset_y.to(dev, torch.long).view(b, 1)
    offset_x = offset_x.to(dev, torch.long).view(b, 1)
    padded = F.pad(x, (pad, pad, pad, pad)) if pad > 0 else x
    rows = offset_y + torch.arange(h, device=dev).view(1, h)  # (B, H)
    cols_plain = offset_x + torch.arange(w, device=dev).view(1, w)  # (B, W)
    cols = torch.where(flip, (w + 2 * pad - 1) - cols_plain, cols_plain)
    # Two gathers (rows, then columns) on the channel-first layout (faster than one advanced index).
    picked_rows = torch.gather(padded, 2, rows.view(b, 1, h, 1).expand(b, c, h, w + 2 * pad))
    return torch.gather(picked_rows, 3, cols.view(b, 1, 1, w).expand(b, c, h, w))


def draw_flip_crop(batch_size: int, generator: torch.Generator, pad: int = 4
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw the random decisions on the generator's device: (flip, offset_y, offset_x), each of shape (B,)."""
    dev = generator.device
    flip = torch.rand(batch_size, generator=generator, device=dev) < 0.5
    crop = torch.rand(batch_size, generator=generator, device=dev) < 0.5
    offsets = torch.randint(0, 2 * pad + 1, (2, batch_size), generator=generator, device=dev)
    centre = torch.full_like(offsets, pad)
    offsets = torch.where(crop.view(1, -1), offsets, centre)
    return flip, offsets[0], offsets[1]


def augment_flip_crop(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Random flip + zero-padded random crop of a normalised float batch (B, C, H, W) (docs/update-rules.md §0).

    Deterministic given ``generator``; the draws happen on the generator's device (CPU or the batch's CUDA
    device) and the result is on ``x``'s device, so a CPU generator gives the same augmentation on any device.
    """
    flip, oy, ox = draw_flip_crop(x.shape[0], generator, pad)
    if generator.device != x.device:  # one host-to-device copy instead of three
        flip, oy, ox = torch.stack([flip.long(), oy, ox]).to(x.device).unbind(0)
    return flip_crop(x, flip, oy, ox, pad)
