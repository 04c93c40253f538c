"""Data loaders: embedded digits, MNIST from .npz or IDX files, synthetic, and clear errors."""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np
import pytest
import torch

from gradq.train.data import DataError, load_dataset

SHARED_MNIST = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "mnist10k.npz")


def test_digits_split_is_fixed_and_scaled():
    pytest.importorskip("sklearn")
    a = load_dataset("digits", seed=0)
    b = load_dataset("digits", seed=0)
    assert torch.equal(a.x_train, b.x_train) and a.num_features == 64 and a.num_classes == 10
    assert a.x_train.shape[0] + a.x_test.shape[0] == 1797
    assert float(a.x_train.min()) >= 0 and float(a.x_train.max()) <= 1


def _write_idx(path, arr, gz):
    head = struct.pack(">BBBB", 0, 0, 8, arr.ndim) + b"".join(struct.pack(">I", d) for d in arr.shape)
    opener = gzip.open if gz else open
    with opener(path, "wb") as f:
        f.write(head + arr.astype(np.uint8).tobytes())


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_from_idx_files(tmp_path, gz):
    x = np.random.default_rng(0).integers(0, 256, (50, 28, 28))
    y = np.arange(50) % 10
    sfx = ".gz" if gz else ""
    _write_idx(tmp_path / f"train-images-idx3-ubyte{sfx}", x, gz)
    _write_idx(tmp_path / f"train-labels-idx1-ubyte{sfx}", y, gz)
    d = load_dataset(f"mnist:{tmp_path}", test_fraction=0.2)
    assert d.num_features == 784 and d.x_train.shape[0] == 40 and d.image_shape == (28, 28)
    assert float(d.x_train.max()) <= 1.0


def test_mnist_from_npz(tmp_path):
    np.savez(tmp_path / "m.npz", X=np.zeros((10, 28, 28), np.uint8), y=np.arange(10))
    assert load_dataset(f"mnist:{tmp_path / 'm.npz'}").x_test.shape == (2, 784)


@pytest.mark.skipif(not os.path.exists(SHARED_MNIST), reason="shared MNIST sample not present")
def test_shared_mnist_sample():
    d = load_dataset(f"mnist:{SHARED_MNIST}")
    assert d.x_train.shape[0] + d.x_test.shape[0] == 10000 and d.num_classes == 10


@pytest.mark.parametrize("spec,msg", [("mnist:", "needs a path"), ("mnist:/nonexistent/x.npz", "does not exist"),
                                      ("cifar", "valid: digits")])
def test_missing_data_says_how_to_provide_it(spec, msg):
    with pytest.raises(DataError, match=msg):
        load_dataset(spec)


def test_corrupt_idx_is_refused(tmp_path):
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\x01\x02junk")
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"\x01\x02junk")
    with pytest.raises(DataError, match="not an IDX file"):
        load_dataset(f"mnist:{tmp_path}")


def test_synthetic():
    d = load_dataset("synthetic", synthetic_size=500)
    assert d.num_features == 64 and d.x_train.shape[0] == 400
