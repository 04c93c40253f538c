"""Data sets that work on a machine with no network.

* ``digits`` — scikit-learn's bundled 8×8 handwritten digits (1797 images, 10 classes): the embedded
  default, installed with the ``data`` extra.
* ``mnist:PATH`` — real MNIST from a path: an ``.npz`` with arrays ``X`` (N, 28, 28) and ``y`` (N,), or a
  folder holding the standard IDX files (``train-images-idx3-ubyte`` etc., optionally gzipped).
* ``synthetic`` — a Gaussian teacher–student classification task of any size.

Every loader returns float32 features in ``[0, 1]`` (flattened) and int64 labels, split into
train/test with a fixed seed.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
import numpy as np
import torch

__all__ = ["Dataset", "load_dataset", "DataError"]


class DataError(RuntimeError):
    """A data set is missing or malformed; the message says how to provide it."""


@dataclass
class Dataset:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    image_shape: tuple[int, int]

    @property
    def num_features(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def _split(name: str, x: np.ndarray, y: np.ndarray, image_shape, test_fraction: float, seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    te, tr = order[:n_test], order[n_test:]
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    yt = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    return Dataset(name, xt[tr], yt[tr], xt[te], yt[te], image_shape)


def _digits() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError("the embedded 'digits' data set needs scikit-learn: pip install 'gradq[data]' "
                        "(or pass mnist:PATH or synthetic)") from None
    d = load_digits()
    return d.data.astype(np.float32) / 16.0, d.target.astype(np.int64)


def _read_idx(path: str) -> np.ndarray:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{path} is not an IDX file")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise DataError(f"{path}: size does not match its header")
    return data.reshape(dims)


def _mnist(path: str) -> tuple[np.ndarray, np.ndarray]:
    hint = ("MNIST needs a path: an .npz with arrays X (N,28,28) and y (N,), or a folder with the IDX files "
            "train-images-idx3-ubyte[.gz] and train-labels-idx1-ubyte[.gz]")
    if not path:
        raise DataError(hint)
    if os.path.isdir(path):
        for cand in ("mnist10k.npz", "mnist.npz"):
            if os.path.exists(os.path.join(path, cand)):
                path = os.path.join(path, cand)
                break
    if os.path.isfile(path) and path.endswith(".npz"):
        with np.load(path) as z:
            if "X" not in z or "y" not in z:
                raise DataError(f"{path} lacks arrays X and y. {hint}")
            x, y = z["X"], z["y"]
    elif os.path.isdir(path):
        def find(stem):
            for suffix in ("", ".gz"):
                p = os.path.join(path, stem + suffix)
                if os.path.exists(p):
                    return p
            raise DataError(f"no {stem}[.gz] in {path}. {hint}")
        x = _read_idx(find("train-images-idx3-ubyte"))
        y = _read_idx(find("train-labels-idx1-ubyte"))
    else:
        raise DataError(f"{path!r} does not exist. {hint}")
    x = x.reshape(len(x), -1).astype(np.float32) / 255.0
    return x, y.astype(np.int64)


def _synthetic(n: int, features: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((features, classes))
    x = rng.random((n, features)).astype(np.float32)
    logits = (x - 0.5) @ teacher
    return x, logits.argmax(1).astype(np.int64)


def load_dataset(spec: str = "digits", *, test_fraction: float = 0.2, seed: int = 0,
                 synthetic_size: int = 4000, synthetic_features: int = 64) -> Dataset:
    """Load ``digits``, ``mnist:PATH`` or ``synthetic`` (see the module docstring)."""
    name, _, arg = spec.partition(":")
    if name == "digits":
        x, y = _digits()
        return _split("digits", x, y, (8, 8), test_fraction, seed)
    if name == "mnist":
        x, y = _mnist(arg)
        return _split("mnist", x, y, (28, 28), test_fraction, seed)
    if name == "synthetic":
        x, y = _synthetic(synthetic_size, synthetic_features, 10, seed)
        side = int(np.sqrt(synthetic_features))
        return _split("synthetic", x, y, (side, side), test_fraction, seed)
    raise DataError(f"unknown data set {spec!r}; valid: digits, mnist:PATH, synthetic")
