"""Dataset readers (flatfl.data.formats) and download/verify/extract (flatfl.data.download).

Every test builds small files in the real on-disk formats (CIFAR pickles, Tiny-ImageNet JPEG tree, EMNIST IDX gz)
inside tmp_path. All archive URLs point at 127.0.0.1 (an unreachable port, a file:// URL or a local http.server),
so nothing leaves the machine.
"""
from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import http.server
import io
import os
import pickle
import tarfile
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from flatfl.data import download, formats, load_dataset
from flatfl.errors import ConfigError, DatasetError

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
UNREACHABLE = "http://127.0.0.1:9/"  # the discard port: refused at once, never leaves the machine


@pytest.fixture(autouse=True)
def offline_archives(monkeypatch):
    """Point every archive URL at an unreachable local port and keep the timeout short."""
    for key, spec in list(download.ARCHIVES.items()):
        monkeypatch.setitem(download.ARCHIVES, key, dataclasses.replace(spec, url=UNREACHABLE + spec.filename))
    monkeypatch.setattr(download, "DOWNLOAD_TIMEOUT", 3.0)


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def patch_archive(monkeypatch, name: str, **changes) -> None:
    monkeypatch.setitem(download.ARCHIVES, name, dataclasses.replace(download.ARCHIVES[name], **changes))


# ------------------------------------------------------------------------------------------------ file builders
def cifar_rows(images: np.ndarray) -> np.ndarray:
    """(N, 3, 32, 32) -> the file's (N, 3072) rows, placing pixel (c, r, col) at c*1024 + r*32 + col."""
    n = images.shape[0]
    rows = np.zeros((n, 3072), dtype=np.uint8)
    c, r, col = np.indices((3, 32, 32)).reshape(3, -1)
    rows[:, c * 1024 + r * 32 + col] = images[:, c, r, col]
    return rows


def write_pickle(path: Path, obj) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def write_cifar10(root: Path, n: int = 20, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    made = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        y = rng.integers(0, 10, n)
        write_pickle(folder / name, {"batch_label": name, "labels": y.tolist(), "data": cifar_rows(x),
                                     "filenames": [f"{name}_{i}.png" for i in range(n)]})
        made[name] = (x, y)
    write_pickle(folder / "batches.meta", {"label_names": CIFAR10_NAMES, "num_cases_per_batch": n, "num_vis": 3072})
    return made


def cifar10_md5s(root: Path) -> dict[str, str]:
    folder = root / "cifar-10-batches-py"
    return {p.name: md5(p) for p in folder.iterdir()}


def write_cifar100(root: Path, n: int = 30, seed: int = 1):
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    made = {}
    for name in ("train", "test"):
        x = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        fine = rng.integers(0, 100, n)
        write_pickle(folder / name, {"data": cifar_rows(x), "fine_labels": fine.tolist(),
                                     "coarse_labels": (fine // 5).tolist(), "filenames": ["f"] * n})
        made[name] = (x, fine)
    write_pickle(folder / "meta", {"fine_label_names": [f"fine{i}" for i in range(100)],
                                   "coarse_label_names": [f"coarse{i}" for i in range(20)]})
    return made


def make_tar_gz(src_parent: Path, folder: str, dest: Path) -> str:
    with tarfile.open(dest, "w:gz") as tf:
        tf.add(src_parent / folder, arcname=folder)
    return md5(dest)


def test_the_archive_table_is_the_one_the_docs_list(tmp_path):
    """archives.json, read into ARCHIVES, holds each archive's URL, md5 and size and each CIFAR file's md5 as
    docs/datasets.md lists them (a row per value); a field of the wrong type in such a file is refused."""
    import json

    docs = (Path(__file__).resolve().parents[1] / "docs" / "datasets.md").read_text()
    archives = download.read_archives()  # ARCHIVES itself: its URLs made unreachable in this module
    assert set(archives) == {"cifar10", "cifar100", "tinyimagenet", "emnist"}
    for spec in archives.values():
        row = next(line for line in docs.splitlines() if line.startswith(f"| {spec.title} | `{spec.filename}`"))
        assert f"({spec.url})" in row and f"`{spec.md5}`" in row and f"{spec.size:,}" in row, row
        for name, md5sum in spec.file_md5.items():
            assert f"| {spec.title} `{name}` | `{md5sum}` |" in docs
    assert sum(len(a.file_md5) for a in archives.values()) == 10 and archives["emnist"].loose_files_ok
    for field, value in (("size", "170 MB"), ("required", "test_batch"), ("file_md5", ["x"]), ("md5", ""),
                         ("sha1", "x")):
        table = json.loads(download.ARCHIVES_FILE.read_text())
        table["archives"]["cifar10"][field] = value
        bad = tmp_path / "archives.json"
        bad.write_text(json.dumps(table))
        with pytest.raises(ValueError, match="'cifar10' has a field of the wrong name or type"):
            download.read_archives(bad)


# ------------------------------------------------------------------------------------------------------- CIFAR
def test_cifar10_layout_labels_names_and_md5(tmp_path, monkeypatch):
    made = write_cifar10(tmp_path)
    patch_archive(monkeypatch, "cifar10", file_md5=cifar10_md5s(tmp_path))
    ds = formats.load_cifar10(tmp_path, download=False)

    assert ds.train_x.shape == (100, 3, 32, 32) and ds.train_x.dtype == torch.uint8
    assert ds.test_x.shape == (20, 3, 32, 32) and ds.test_y.dtype == torch.int64
    expected_x = np.concatenate([made[f"data_batch_{i}"][0] for i in range(1, 6)])
    expected_y = np.concatenate([made[f"data_batch_{i}"][1] for i in range(1, 6)])
    assert np.array_equal(ds.train_x.numpy(), expected_x)
    assert np.array_equal(ds.train_y.numpy(), expected_y)
    assert np.array_equal(ds.test_x.numpy(), made["test_batch"][0])
    assert ds.class_names == CIFAR10_NAMES and ds.num_classes == 10
    assert ds.mean == (0.491, 0.482, 0.447) and ds.std == (0.247, 0.243, 0.262)
    assert ds.augment_default is True


def test_cifar_plane_order_by_hand(tmp_path, monkeypatch):
    """One row of the file: byte 1024 + 5*32 + 7 is green, row 5, column 7."""
    write_cifar10(tmp_path, n=2)
    folder = tmp_path / "cifar-10-batches-py"
    d = pickle.loads((folder / "data_batch_1").read_bytes(), encoding="latin1")
    d["data"][1] = 0
    d["data"][1, 1024 + 5 * 32 + 7] = 201
    d["data"][1, 2 * 1024 + 31 * 32 + 0] = 77
    write_pickle(folder / "data_batch_1", d)
    patch_archive(monkeypatch, "cifar10", file_md5={})
    img = formats.load_cifar10(tmp_path, download=False).train_x[1]
    assert img[1, 5, 7] == 201 and img[2, 31, 0] == 77 and int(img.sum()) == 201 + 77


def test_cifar10_per_file_checksum_mismatch(tmp_path, monkeypatch):
    write_cifar10(tmp_path)
    sums = cifar10_md5s(tmp_path)
    real = sums["data_batch_3"]
    sums["data_batch_3"] = "0" * 32
    patch_archive(monkeypatch, "cifar10", file_md5=sums)
    with pytest.raises(DatasetError, match=r"checksum mismatch for .*data_batch_3: expected 0{32}, got " + real):
        formats.load_cifar10(tmp_path, download=False)


def test_cifar100_fine_labels_and_official_file_md5s(tmp_path, monkeypatch):
    made = write_cifar100(tmp_path)
    # The table holds CIFAR-100's published per-file md5s: our synthetic files cannot match them.
    with pytest.raises(DatasetError, match="checksum mismatch for .*cifar-100-python/(train|test|meta)"):
        formats.load_cifar100(tmp_path, download=False)
    folder = tmp_path / "cifar-100-python"
    patch_archive(monkeypatch, "cifar100", file_md5={n: md5(folder / n) for n in ("train", "test", "meta")})
    ds = formats.load_cifar100(tmp_path, download=False)
    assert ds.train_x.shape == (30, 3, 32, 32) and ds.num_classes == 100
    assert np.array_equal(ds.train_y.numpy(), made["train"][1])  # fine, not coarse, labels
    assert np.array_equal(ds.test_x.numpy(), made["test"][0])
    assert ds.class_names[:2] == ["fine0", "fine1"] and len(ds.class_names) == 100
    assert ds.mean == (0.5071, 0.4867, 0.4408) and ds.std == (0.2675, 0.2565, 0.2761)


@pytest.mark.parametrize("damage, message", [
    ("truncate", r"cannot read CIFAR pickle .*data_batch_2"),
    ("wrong_shape", r"data_batch_2: 'data' is uint8 \(20, 3000\)"),
    ("label_count", r"data_batch_2: 19 labels for 20 images"),
    ("bad_label", r"data_batch_2: labels outside 0..9"),
    ("evil_global", r"data_batch_2: .*refusing to load global (posix|nt).system"),
])
def test_cifar_corrupt_batch(tmp_path, monkeypatch, damage, message):
    write_cifar10(tmp_path)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    d = pickle.loads(path.read_bytes(), encoding="latin1")
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:5000])
    elif damage == "wrong_shape":
        d["data"] = d["data"][:, :3000].copy()
        write_pickle(path, d)
    elif damage == "label_count":
        d["labels"] = d["labels"][:19]
        write_pickle(path, d)
    elif damage == "bad_label":
        d["labels"][3] = 10
        write_pickle(path, d)
    else:
        class Evil:
            def __reduce__(self):
                return (os.system, ("echo pwned",))
        d["labels"] = Evil()
        write_pickle(path, d)
    patch_archive(monkeypatch, "cifar10", file_md5={})
    with pytest.raises(DatasetError, match=message):
        formats.load_cifar10(tmp_path, download=False)


def test_root_may_be_the_dataset_folder_itself(tmp_path, monkeypatch):
    write_cifar10(tmp_path)
    patch_archive(monkeypatch, "cifar10", file_md5={})
    ds = formats.load_cifar10(tmp_path / "cifar-10-batches-py", download=False)
    assert ds.train_x.shape[0] == 100


def test_load_dataset_end_to_end(tmp_path, monkeypatch):
    made = write_cifar10(tmp_path)
    patch_archive(monkeypatch, "cifar10", file_md5=cifar10_md5s(tmp_path))
    ds = load_dataset("CIFAR-10", tmp_path, download=False)
    assert ds.name == "cifar10" and ds.input_shape == (3, 32, 32) and ds.num_classes == 10
    batch = ds.normalize(ds.train_x[:4])
    raw = made["data_batch_1"][0][:4].astype(np.float64) / 255.0
    expected = (raw - np.array([0.491, 0.482, 0.447])[None, :, None, None]) / np.array(
        [0.247, 0.243, 0.262])[None, :, None, None]
    assert batch.dtype == torch.float32
    np.testing.assert_allclose(batch.numpy(), expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- Tiny-ImageNet
TINY_WNIDS = ["n03000000", "n01000000", "n02000000"]  # wnids.txt order; labels follow the sorted order
TINY_COLOURS = {"n01000000": (200, 30, 30), "n02000000": (30, 200, 30), "n03000000": (30, 30, 200)}


def write_tiny(root: Path) -> Path:
    from PIL import Image

    folder = root / "tiny-imagenet-200"
    (folder / "val" / "images").mkdir(parents=True)
    (folder / "wnids.txt").write_text("\n".join(TINY_WNIDS) + "\n")
    (folder / "words.txt").write_text("n01000000\tred thing\nn02000000\tgreen thing\nn03000000\tblue thing\n"
                                      "n09999999\tunused\n")
    for w in TINY_WNIDS:
        images = folder / "train" / w / "images"
        images.mkdir(parents=True)
        (folder / "train" / w / f"{w}_boxes.txt").write_text("")
        for i in range(2):
            Image.new("RGB", (64, 64), TINY_COLOURS[w]).save(images / f"{w}_{i}.JPEG", quality=95)
    # One greyscale training image (Tiny-ImageNet has some).
    Image.new("L", (64, 64), 90).save(folder / "train" / "n02000000" / "images" / "n02000000_2.JPEG", quality=95)
    lines = []
    for i, w in enumerate(["n02000000", "n03000000", "n01000000"]):
        Image.new("RGB", (64, 64), TINY_COLOURS[w]).save(folder / "val" / "images" / f"val_{i}.JPEG", quality=95)
        lines.append(f"val_{i}.JPEG\t{w}\t0\t0\t63\t63")
    (folder / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return folder


def test_tinyimagenet_decode_labels_and_cache(tmp_path, monkeypatch):
    folder = write_tiny(tmp_path)
    ds = formats.load_tinyimagenet(tmp_path, download=False)
    assert ds.train_x.shape == (7, 3, 64, 64) and ds.train_x.dtype == torch.uint8
    assert ds.test_x.shape == (3, 3, 64, 64) and ds.num_classes == 3
    assert ds.train_y.tolist() == [0, 0, 1, 1, 1, 2, 2]  # sorted wnids, sorted files (grey one is _2)
    assert ds.test_y.tolist() == [1, 2, 0]
    assert ds.class_names == ["red thing", "green thing", "blue thing"]
    assert ds.augment_default and ds.mean == (0.4802, 0.4481, 0.3975) and ds.std == (0.2302, 0.2265, 0.2262)
    # Solid colours survive JPEG to within a few levels; channel order is RGB.
    red = ds.train_x[0].float().mean(dim=(1, 2))
    assert torch.allclose(red, torch.tensor([200.0, 30.0, 30.0]), atol=4)
    grey = ds.train_x[4]
    assert torch.equal(grey[0], grey[1]) and torch.equal(grey[1], grey[2]) and abs(grey.float().mean() - 90) < 3

    cache = folder / "flatfl-decoded.npz"
    assert cache.is_file() and not [p for p in folder.iterdir() if p.name.endswith(".tmp")]

    import PIL.Image

    def no_decoding(*a, **k):
        raise AssertionError("the second load must come from the cache")

    with monkeypatch.context() as m:
        m.setattr(PIL.Image, "open", no_decoding)
        again = formats.load_tinyimagenet(tmp_path, download=False)
    assert torch.equal(again.train_x, ds.train_x) and torch.equal(again.test_y, ds.test_y)

    # Changing the annotations invalidates the cache.
    ann = folder / "val" / "val_annotations.txt"
    ann.write_text(ann.read_text().replace("val_0.JPEG\tn02000000", "val_0.JPEG\tn03000000"))
    assert formats.load_tinyimagenet(tmp_path, download=False).test_y.tolist() == [2, 2, 0]


def test_tinyimagenet_unreadable_jpeg(tmp_path):
    folder = write_tiny(tmp_path)
    bad = folder / "train" / "n01000000" / "images" / "n01000000_1.JPEG"
    bad.write_bytes(bad.read_bytes()[:300])  # truncated JPEG
    with pytest.raises(DatasetError, match=r"cannot decode image .*n01000000_1.JPEG"):
        formats.load_tinyimagenet(tmp_path, download=False)
    bad.write_bytes(b"this is not an image")
    with pytest.raises(DatasetError, match=r"cannot decode image .*n01000000_1.JPEG"):
        formats.load_tinyimagenet(tmp_path, download=False)


def test_tinyimagenet_bad_annotation(tmp_path):
    folder = write_tiny(tmp_path)
    (folder / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn07777777\t0\t0\t1\t1\n")
    with pytest.raises(DatasetError, match=r"val_annotations.txt line 1"):
        formats.load_tinyimagenet(tmp_path, download=False)


# ------------------------------------------------------------------------------------------------------- EMNIST
def idx_bytes(array: np.ndarray, magic: int) -> bytes:
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def upright_letter_l(n: int) -> np.ndarray:
    """n copies of an 'L': a vertical bar in column 4 (rows 3..22) and a foot along row 22 (columns 5..16)."""
    img = np.zeros((28, 28), dtype=np.uint8)
    img[3:23, 4] = 255
    img[22, 5:17] = 128
    out = np.repeat(img[None], n, axis=0)
    out[:, 0, 0] = np.arange(n)  # make every image distinct (order check)
    return out


def write_emnist(folder: Path, split: str, n_train=12, n_test=5, num_classes=62, label_offset=0, seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    truth = {}
    for part, n in (("train", n_train), ("test", n_test)):
        upright = upright_letter_l(n)
        labels = rng.integers(0, num_classes, n) + label_offset
        stored = upright.transpose(0, 2, 1)  # the files hold each image transposed
        (folder / f"emnist-{split}-{part}-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(stored, 0x803)))
        (folder / f"emnist-{split}-{part}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(labels, 0x801)))
        truth[part] = (upright, labels - label_offset)
    return truth


def test_emnist_default_split_orientation_and_stats(tmp_path):
    truth = write_emnist(tmp_path / "gzip", "byclass")
    ds = formats.load_emnist(tmp_path, download=False)
    assert ds.train_x.shape == (12, 1, 28, 28) and ds.train_x.dtype == torch.uint8
    assert ds.num_classes == 62 and ds.class_names[9] == "9" and ds.class_names[10] == "A"
    assert ds.class_names[36] == "a" and ds.class_names[61] == "z"
    assert np.array_equal(ds.train_x[:, 0].numpy(), truth["train"][0])
    assert np.array_equal(ds.test_y.numpy(), truth["test"][1])
    img = ds.train_x[3, 0]
    assert img[3:23, 4].eq(255).all() and img[22, 5:17].eq(128).all() and img[4, 3:23].sum() == 255  # upright 'L'
    pixels = truth["train"][0].astype(np.float64) / 255.0
    assert ds.mean[0] == pytest.approx(pixels.mean(), rel=1e-12)
    assert ds.std[0] == pytest.approx(pixels.std(), rel=1e-12)
    assert ds.augment_default is False


def test_emnist_other_splits_and_loose_files(tmp_path):
    write_emnist(tmp_path, "balanced", num_classes=47)
    ds = formats.load_emnist(tmp_path, download=False, split="balanced")  # .gz files directly in root
    assert ds.num_classes == 47 and ds.class_names[36:] == list("abdefghnqrt")
    truth = write_emnist(tmp_path / "gzip", "letters", num_classes=26, label_offset=1)
    ds = formats.load_emnist(tmp_path, download=False, split="letters")  # file labels 1..26 -> 0..25
    assert ds.num_classes == 26 and np.array_equal(ds.train_y.numpy(), truth["train"][1])
    with pytest.raises(ConfigError, match="unknown EMNIST split 'bogus'"):
        formats.load_emnist(tmp_path, split="bogus")


@pytest.mark.parametrize("damage, message", [
    ("magic", r"emnist-byclass-train-images-idx3-ubyte.gz has magic number 0x00000801, expected 0x00000803"),
    ("short_data", r"emnist-byclass-train-images-idx3-ubyte.gz has \d+ bytes, its header \(12, 28, 28\) implies"),
    ("cut_gzip", r"cannot decompress IDX file .*emnist-byclass-train-images-idx3-ubyte.gz"),
    ("not_gzip", r"cannot decompress IDX file .*emnist-byclass-train-images-idx3-ubyte.gz"),
    ("label_count", r"emnist-byclass-train-labels-idx1-ubyte.gz has 11 labels for the 12 images"),
    ("label_range", r"emnist-byclass-train-labels-idx1-ubyte.gz: labels outside 0..61"),
])
def test_emnist_corrupt_files(tmp_path, damage, message):
    folder = tmp_path / "gzip"
    write_emnist(folder, "byclass")
    images = folder / "emnist-byclass-train-images-idx3-ubyte.gz"
    labels = folder / "emnist-byclass-train-labels-idx1-ubyte.gz"
    raw = gzip.decompress(images.read_bytes())
    if damage == "magic":
        images.write_bytes(gzip.compress(b"\x00\x00\x08\x01" + raw[4:]))
    elif damage == "short_data":
        images.write_bytes(gzip.compress(raw[:-100]))
    elif damage == "cut_gzip":
        images.write_bytes(images.read_bytes()[:40])
    elif damage == "not_gzip":
        images.write_bytes(raw)
    elif damage == "label_count":
        labels.write_bytes(gzip.compress(idx_bytes(np.zeros(11, np.uint8), 0x801)))
    else:
        labels.write_bytes(gzip.compress(idx_bytes(np.full(12, 62, np.uint8), 0x801)))
    with pytest.raises(DatasetError, match=message):
        formats.load_emnist(tmp_path, download=False)


# --------------------------------------------------------------------------------------- missing data / download
def leftovers(root: Path) -> list[str]:
    """Hidden temporaries (.part downloads, .extracting folders) left in root."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_missing_without_download_names_path_and_url(tmp_path):
    spec = download.ARCHIVES["cifar10"]
    with pytest.raises(DatasetError) as info:
        formats.load_cifar10(tmp_path, download=False)
    msg = str(info.value)
    assert str(tmp_path / "cifar-10-batches-py") in msg and "data_batch_1..5" in msg
    assert spec.url in msg and "download=False" in msg and "\n" not in msg


def test_missing_with_unreachable_network(tmp_path):
    with pytest.raises(DatasetError) as info:
        formats.load_emnist(tmp_path / "data", download=True)
    msg = str(info.value)
    assert str(tmp_path / "data" / "gzip") in msg and "http://127.0.0.1:9/gzip.zip" in msg
    assert "could not download" in msg
    assert leftovers(tmp_path / "data") == [] and not (tmp_path / "data" / "gzip.zip").exists()


def test_archive_in_root_is_verified_and_extracted(tmp_path, monkeypatch):
    staging, root = tmp_path / "staging", tmp_path / "root"
    made = write_cifar10(staging)
    root.mkdir()
    digest = make_tar_gz(staging, "cifar-10-batches-py", root / "cifar-10-python.tar.gz")
    patch_archive(monkeypatch, "cifar10", md5=digest, file_md5=cifar10_md5s(staging))
    ds = formats.load_cifar10(root, download=False)
    assert np.array_equal(ds.test_x.numpy(), made["test_batch"][0])
    assert sorted(p.name for p in root.iterdir()) == ["cifar-10-batches-py", "cifar-10-python.tar.gz"]


def test_archive_in_root_with_wrong_md5(tmp_path, monkeypatch):
    staging = tmp_path / "staging"
    write_cifar10(staging)
    root = tmp_path / "root"
    root.mkdir()
    digest = make_tar_gz(staging, "cifar-10-batches-py", root / "cifar-10-python.tar.gz")
    patch_archive(monkeypatch, "cifar10", md5="f" * 32, file_md5={})
    with pytest.raises(DatasetError, match=f"checksum mismatch for .*cifar-10-python.tar.gz: expected f{{32}}, "
                                           f"got {digest}"):
        formats.load_cifar10(root, download=True)
    assert sorted(p.name for p in root.iterdir()) == ["cifar-10-python.tar.gz"]


def test_download_from_file_url(tmp_path, monkeypatch):
    staging, root = tmp_path / "staging", tmp_path / "root"
    made = write_cifar100(staging)
    digest = make_tar_gz(staging, "cifar-100-python", tmp_path / "mirror.tar.gz")
    patch_archive(monkeypatch, "cifar100", url=(tmp_path / "mirror.tar.gz").as_uri(), md5=digest,
                  file_md5={n: md5(staging / "cifar-100-python" / n) for n in ("train", "test", "meta")})
    with pytest.raises(DatasetError, match="could not download .*download=False"):
        formats.load_cifar100(root, download=False)
    ds = formats.load_cifar100(root, download=True)
    assert np.array_equal(ds.train_x.numpy(), made["train"][0])
    assert sorted(p.name for p in root.iterdir()) == ["cifar-100-python", "cifar-100-python.tar.gz"]
    assert md5(root / "cifar-100-python.tar.gz") == digest


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def local_http(tmp_path):
    """An http.server on 127.0.0.1 serving tmp_path/served; yields its base URL."""
    served = tmp_path / "served"
    served.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=served))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield served, f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_download_zip_over_local_http(tmp_path, monkeypatch, local_http):
    served, base = local_http
    truth = write_emnist(tmp_path / "staging" / "gzip", "byclass")
    with zipfile.ZipFile(served / "gzip.zip", "w") as zf:
        for p in sorted((tmp_path / "staging" / "gzip").iterdir()):
            zf.write(p, f"gzip/{p.name}")
    patch_archive(monkeypatch, "emnist", url=base + "gzip.zip", md5=md5(served / "gzip.zip"))
    root = tmp_path / "root"
    ds = formats.load_emnist(root)
    assert np.array_equal(ds.train_x[:, 0].numpy(), truth["train"][0])
    assert sorted(p.name for p in root.iterdir()) == ["gzip", "gzip.zip"]


def test_download_with_wrong_md5_keeps_nothing(tmp_path, monkeypatch, local_http):
    served, base = local_http
    (served / "cifar-10-python.tar.gz").write_bytes(b"not the archive you are looking for")
    patch_archive(monkeypatch, "cifar10", url=base + "cifar-10-python.tar.gz")
    root = tmp_path / "root"
    with pytest.raises(DatasetError, match="checksum mismatch for cifar-10-python.tar.gz downloaded from"):
        formats.load_cifar10(root)
    assert list(root.iterdir()) == []


def test_download_404_is_a_dataset_error(tmp_path, monkeypatch, local_http):
    _, base = local_http
    patch_archive(monkeypatch, "tinyimagenet", url=base + "missing.zip")
    with pytest.raises(DatasetError, match=r"could not download it \(.*missing.zip: HTTP 404 File not found\)"):
        formats.load_tinyimagenet(tmp_path / "root")
    assert list((tmp_path / "root").iterdir()) == []


def test_failed_extraction_leaves_nothing(tmp_path, monkeypatch):
    staging, root = tmp_path / "staging", tmp_path / "root"
    write_cifar10(staging)
    root.mkdir()
    full = tmp_path / "full.tar.gz"
    make_tar_gz(staging, "cifar-10-batches-py", full)
    archive = root / "cifar-10-python.tar.gz"
    archive.write_bytes(full.read_bytes()[: full.stat().st_size // 2])  # truncated, but with the "right" md5
    patch_archive(monkeypatch, "cifar10", md5=md5(archive), file_md5={})
    with pytest.raises(DatasetError, match=r"cannot extract .*cifar-10-python.tar.gz"):
        formats.load_cifar10(root)
    assert sorted(p.name for p in root.iterdir()) == ["cifar-10-python.tar.gz"]


def test_archive_without_the_expected_folder(tmp_path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "readme.txt").write_text("hello")
    digest = make_tar_gz(tmp_path, "other", root / "cifar-10-python.tar.gz")
    patch_archive(monkeypatch, "cifar10", md5=digest)
    with pytest.raises(DatasetError, match=r"does not contain cifar-10-batches-py/"):
        formats.load_cifar10(root)
    assert sorted(p.name for p in root.iterdir()) == ["cifar-10-python.tar.gz"]


def test_unsafe_zip_member_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("../escaped.txt", "outside")
        zf.writestr("tiny-imagenet-200/wnids.txt", "n01000000\n")
    (root / "tiny-imagenet-200.zip").write_bytes(buf.getvalue())
    patch_archive(monkeypatch, "tinyimagenet", md5=md5(root / "tiny-imagenet-200.zip"))
    with pytest.raises(DatasetError, match="refusing to extract unsafe member '../escaped.txt'"):
        formats.load_tinyimagenet(root)
    assert not (tmp_path / "escaped.txt").exists() and leftovers(root) == []
    assert not (root / "tiny-imagenet-200").exists()


def test_incomplete_folder_is_reported_not_overwritten(tmp_path, monkeypatch):
    write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_5").unlink()
    with pytest.raises(DatasetError, match=r"cifar-10-batches-py is incomplete \(missing data_batch_5\)"):
        formats.load_cifar10(tmp_path)
    assert (tmp_path / "cifar-10-batches-py" / "data_batch_1").is_file()


def test_unknown_archive_name():
    with pytest.raises(ConfigError, match="no archive known for dataset 'mnist'"):
        download.ensure_dataset("mnist", "/nonexistent")


def test_killed_download_temporaries_are_removed_by_the_next_download(tmp_path, monkeypatch):
    """A download / extraction killed midway leaves `.NAME.PID.XXXXXXXX.part` / `.extracting`: the next download
    removes those whose process is gone, and keeps a user's file and a live process's temporary."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    dead = p.pid
    staging, root = tmp_path / "staging", tmp_path / "root"
    write_cifar100(staging)
    digest = make_tar_gz(staging, "cifar-100-python", tmp_path / "mirror.tar.gz")
    patch_archive(monkeypatch, "cifar100", url=(tmp_path / "mirror.tar.gz").as_uri(), md5=digest,
                  file_md5={n: md5(staging / "cifar-100-python" / n) for n in ("train", "test", "meta")})
    root.mkdir()
    (root / f".cifar-100-python.tar.gz.{dead}.ab12cd34.part").write_bytes(b"half an archive")
    (root / f".cifar-100-python.{dead}.q_w2e3r4.extracting").mkdir()
    (root / f".cifar-100-python.{dead}.q_w2e3r4.extracting" / "train").write_bytes(b"half")
    kept = [f".cifar-100-python.tar.gz.{os.getppid()}.ab12cd34.part", ".cifar-100-python.tar.gz.part", ".notes"]
    for name in kept:
        (root / name).write_bytes(b"keep")
    formats.load_cifar100(root, download=True)
    assert leftovers(root) == sorted(kept)


def test_the_digits_read_from_scikit_learns_file_are_load_digits():
    """flatfl reads the digits from scikit-learn's CSV file without importing scikit-learn: the same images and
    labels as ``sklearn.datasets.load_digits``."""
    from sklearn.datasets import load_digits

    from flatfl.data.datasets import digits_arrays

    images, labels = digits_arrays()
    reference = load_digits()
    assert np.array_equal(images, reference.images) and np.array_equal(labels, reference.target)
