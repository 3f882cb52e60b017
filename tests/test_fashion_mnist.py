"""Fashion-MNIST: the data-dir, then Debian's /usr/share/datasets/fashion-mnist, then --download (md5 of the .gz,
sha256 of the decompressed bytes); the one-line message when it is missing; partitions and 28x28x1 models.

The real files are used where Debian's package is installed (``bash install.sh data``); every other test builds
small IDX files and points the checksums at them, so the suite needs neither the package nor the network."""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from flatfl.cli import main
from flatfl.data import download, load_dataset
from flatfl.data.partition import make_partition
from flatfl.errors import DatasetError

REAL = download.DEBIAN_FASHION_MNIST
HAVE_REAL = all((REAL / f.name).is_file() for f in download.FASHION_MNIST_FILES)
NAMES = [f.name for f in download.FASHION_MNIST_FILES]


def idx_bytes(array: np.ndarray, magic: int) -> bytes:
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def small_set(n_train=40, n_test=20, seed=0):
    """Images whose pixel (r, c) encodes (r, c) (orientation check) and whose first pixel is the index."""
    rng = np.random.default_rng(seed)
    out = {}
    for part, n in (("train", n_train), ("t10k", n_test)):
        r, c = np.indices((28, 28))
        img = ((r * 7 + c * 3) % 251).astype(np.uint8)
        x = np.repeat(img[None], n, axis=0)
        x[:, 0, 0] = np.arange(n)
        y = np.arange(n) % 10
        rng.shuffle(y)
        out[part] = (x, y)
    return out


def write_small(folder: Path, data) -> dict[str, bytes]:
    """The four .gz files of ``data`` in ``folder``; returns name -> decompressed bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    raw = {}
    for part in ("train", "t10k"):
        x, y = data[part]
        raw[f"{part}-images-idx3-ubyte.gz"] = idx_bytes(x, 0x803)
        raw[f"{part}-labels-idx1-ubyte.gz"] = idx_bytes(y, 0x801)
    for name, b in raw.items():
        (folder / name).write_bytes(gzip.compress(b, mtime=0))
    return raw


@pytest.fixture
def small(monkeypatch, tmp_path):
    """Small IDX files in tmp/data/fashion-mnist, checksums pointed at them, no Debian copy, no network."""
    data = small_set()
    folder = tmp_path / "data" / "fashion-mnist"
    raw = write_small(folder, data)
    files = tuple(dataclasses.replace(f, sha256=hashlib.sha256(raw[f.name]).hexdigest(),
                                      gz_md5=hashlib.md5((folder / f.name).read_bytes()).hexdigest())
                  for f in download.FASHION_MNIST_FILES)
    monkeypatch.setattr(download, "FASHION_MNIST_FILES", files)
    monkeypatch.setattr(download, "DEBIAN_FASHION_MNIST", tmp_path / "no-debian")
    monkeypatch.setattr(download, "FASHION_MNIST_URL", "http://127.0.0.1:9/")  # refused at once
    monkeypatch.setattr(download, "DOWNLOAD_TIMEOUT", 3.0)
    return tmp_path / "data", folder, data


def test_small_files_read_upright_with_exact_stats(small):
    root, _, data = small
    ds = load_dataset("fashion-mnist", root)
    assert ds.name == "fashion-mnist" and ds.num_classes == 10 and ds.class_names[0] == "T-shirt/top"
    assert ds.train_x.shape == (40, 1, 28, 28) and ds.test_x.shape == (20, 1, 28, 28)
    assert ds.train_x.dtype == torch.uint8
    assert np.array_equal(ds.train_x[:, 0].numpy(), data["train"][0])  # stored upright: no transpose
    assert np.array_equal(ds.test_y.numpy(), data["t10k"][1])
    xf = data["train"][0].astype(np.float64) / 255
    assert ds.mean[0] == pytest.approx(xf.mean(), abs=1e-12) and ds.std[0] == pytest.approx(xf.std(), abs=1e-12)
    assert not ds.augment_default
    assert load_dataset("Fashion_MNIST", root).train_x.shape == (40, 1, 28, 28)  # spellings
    assert load_dataset("fashionmnist", root / "fashion-mnist").train_x.shape == (40, 1, 28, 28)  # files in root


def test_debian_location_is_the_fallback(small, monkeypatch, tmp_path):
    _, folder, data = small
    monkeypatch.setattr(download, "DEBIAN_FASHION_MNIST", folder)
    ds = load_dataset("fashion-mnist", tmp_path / "empty")
    assert np.array_equal(ds.train_y.numpy(), data["train"][1])
    assert not (tmp_path / "empty").exists()  # nothing written when read from Debian's folder


def test_missing_is_one_line_naming_apt_and_download(small, tmp_path):
    with pytest.raises(DatasetError) as e:
        load_dataset("fashion-mnist", tmp_path / "empty")
    msg = str(e.value)
    assert "apt-get install dataset-fashion-mnist" in msg and "--download" in msg and "\n" not in msg
    assert str(tmp_path / "no-debian") in msg
    assert not (tmp_path / "empty").exists()


def test_cli_train_missing_message_and_exit(small, tmp_path):
    res = CliRunner().invoke(main, ["train", "--dataset", "fashion-mnist", "--data-dir", str(tmp_path / "empty"),
                                    "--out", str(tmp_path / "run"), "--quiet", "--threads", "1"])
    assert res.exit_code != 0
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "dataset-fashion-mnist" in lines[0] and "--download" in lines[0], res.output
    assert "Traceback" not in res.output


def test_download_checks_md5_and_leaves_nothing_half_written(small, monkeypatch, tmp_path):
    _, folder, data = small
    mirror = folder  # a local mirror served by urllib's file: scheme
    monkeypatch.setattr(download, "FASHION_MNIST_URL", mirror.as_uri() + "/")
    root = tmp_path / "fresh"
    ds = load_dataset("fashion-mnist", root, download=True)
    assert sorted(p.name for p in (root / "fashion-mnist").iterdir()) == sorted(NAMES)
    assert np.array_equal(ds.train_x[:, 0].numpy(), data["train"][0])
    bad = tuple(dataclasses.replace(f, gz_md5="0" * 32) if f.name.startswith("t10k-labels") else f
                for f in download.FASHION_MNIST_FILES)
    monkeypatch.setattr(download, "FASHION_MNIST_FILES", bad)
    other = tmp_path / "other"
    with pytest.raises(DatasetError, match="checksum mismatch for t10k-labels"):
        load_dataset("fashion-mnist", other, download=True)
    left = sorted(p.name for p in (other / "fashion-mnist").iterdir())
    assert "t10k-labels-idx1-ubyte.gz" not in left and not any(n.endswith(".part") for n in left)


def test_unreachable_download_names_both_ways(small, tmp_path):
    with pytest.raises(DatasetError) as e:
        load_dataset("fashion-mnist", tmp_path / "x", download=True)
    msg = str(e.value)
    assert "could not download" in msg and "dataset-fashion-mnist" in msg and "\n" not in msg


def test_corrupt_file_fails_its_checksum(small):
    root, folder, data = small
    x, y = data["t10k"]
    y2 = y.copy()
    y2[0] = (y2[0] + 1) % 10  # a valid IDX file with one label changed
    (folder / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(y2, 0x801)))
    with pytest.raises(DatasetError, match="checksum mismatch.*t10k-labels"):
        load_dataset("fashion-mnist", root)


def test_partitions_cover_every_image(small):
    root, _, _ = small
    labels = load_dataset("fashion-mnist", root).train_y.numpy()
    for method in ("dirichlet", "fedml-dirichlet", "iid"):
        part = make_partition(labels, 4, method, 0.5, 0)
        idx = np.concatenate([np.asarray(c) for c in part.client_indices])
        assert sorted(idx.tolist()) == list(range(len(labels))), method


def model_list():
    from flatfl.models.model_registry import model_names

    return model_names()


@pytest.mark.parametrize("name", model_list())
def test_every_model_takes_28x28x1(name):
    from flatfl.models.model_registry import build_model

    torch.manual_seed(0)
    model = build_model(name, num_classes=10, in_channels=1, image_size=28).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 1, 28, 28))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


def test_cli_train_on_fashion_mnist(small, tmp_path):
    root, _, _ = small
    res = CliRunner().invoke(main, ["train", "--dataset", "fashion-mnist", "--data-dir", str(root), "--model", "mlp",
                                    "--clients", "4", "--participation", "1", "--rounds", "2", "--local-epochs", "1",
                                    "--batch-size", "10", "--out", str(tmp_path / "run"), "--quiet", "--threads", "1"])
    assert res.exit_code == 0, res.output
    assert "round 2: test accuracy" in res.output
    metrics = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert len(metrics) == 3  # header + 2 rounds


@pytest.mark.skipif(not HAVE_REAL, reason="Debian's dataset-fashion-mnist is not installed (bash install.sh data)")
def test_real_files_from_the_debian_package(tmp_path):
    ds = load_dataset("fashion-mnist", tmp_path / "empty")  # nothing in data-dir: Debian's files, sha256-checked
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert ds.train_y.bincount().tolist() == [6000] * 10 and ds.test_y.bincount().tolist() == [1000] * 10
    assert ds.mean[0] == pytest.approx(0.2860, abs=5e-5) and ds.std[0] == pytest.approx(0.3530, abs=5e-5)
