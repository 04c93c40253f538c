"""Data sets that work on a machine with no network.

Specs accepted by :func:`load_dataset` (``image_shape`` is always ``(C, H, W)``):

* ``digits`` — scikit-learn's bundled 8×8 handwritten digits (1797 images, 10 classes, (1, 8, 8)): the
  embedded default, installed with the ``data`` extra.
* ``mnist:PATH`` — real MNIST, (1, 28, 28), from an ``.npz`` with arrays ``X`` (N, 28, 28) and ``y`` (N,)
  (or Keras' ``x_train``/``y_train``/``x_test``/``y_test``); a folder holding ``mnist10k.npz`` or
  ``mnist.npz``; or a folder with the IDX files ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``
  (and ``t10k-…`` for the test set), optionally gzipped, directly, in ``raw/`` or in torchvision's layout
  ``<root>/MNIST/raw/`` (plain file reading; torchvision is not needed). ``mnist`` with no path searches
  ``$GRADQ_DATA`` (folders joined with ``os.pathsep``), ``~/.cache/gradq``, then
  ``../shared/data/mnist10k.npz`` relative to the current directory and to the source checkout.
* ``cifar10:PATH`` — CIFAR-10, (3, 32, 32), from the python version's ``cifar-10-batches-py/``
  (``data_batch_1`` … ``data_batch_5``, ``test_batch``), its parent, or the ``cifar-10-python.tar.gz``
  archive. ``cifar10`` with no path searches ``$GRADQ_DATA`` and ``~/.cache/gradq`` (torchvision's
  ``root``), then asks torchvision (``download=False``) if it imports. Batches are unpickled by a loader
  that admits numpy arrays only, so a crafted file cannot run code.
* ``synthetic[:KEY=VALUE,...]`` — Gaussian inputs labelled by a fixed random teacher network, any size
  (keys and defaults: :func:`synthetic_task`).

Every loader returns float32 features flattened to ``(N, C*H*W)`` (images in ``[0, 1]``; synthetic inputs
standard normal) and int64 labels. Data that come with a train/test split (IDX MNIST with ``t10k`` files,
Keras' ``.npz``, CIFAR-10) keep it unless ``official_split=False``; the rest are split at random with
``test_fraction`` and ``seed``.
"""

from __future__ import annotations

import codecs
import gzip
import io
import os
import pickle
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

__all__ = ["Dataset", "load_dataset", "DataError", "synthetic_task", "DATA_ENV", "SYNTHETIC_DEFAULTS"]

#: environment variable naming the folder(s) searched for ``mnist`` and ``cifar10`` given without a path
DATA_ENV = "GRADQ_DATA"
#: the source checkout (``<repo>/src/gradq/train/data.py`` -> ``<repo>``); ``<repo>/../shared/data`` is searched
REPO_ROOT = Path(__file__).resolve().parents[3]

Arrays = tuple[np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray]]  # x, y, x_test, y_test


class DataError(RuntimeError):
    """A data set is missing or malformed; the message says how to provide it."""


@dataclass
class Dataset:
    """Train and test tensors: ``x`` float32 ``(N, C*H*W)``, ``y`` int64 ``(N,)``."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    image_shape: tuple[int, int, int]
    #: number of classes when the source defines it (otherwise inferred from the labels)
    classes: Optional[int] = None

    @property
    def num_features(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def num_classes(self) -> int:
        if self.classes is not None:
            return int(self.classes)
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def _digits() -> Arrays:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError("the embedded 'digits' data set needs scikit-learn: pip install 'gradq[data]' "
                        "(or pass mnist:PATH or synthetic)") from None
    d = load_digits()
    return d.data.astype(np.float32) / 16.0, d.target.astype(np.int64), None, None


def _read_idx(path: str) -> np.ndarray:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{path} is not an IDX file")
    if raw[2] != 0x08:
        raise DataError(f"{path}: IDX data type 0x{raw[2]:02x} is not unsigned bytes (0x08), as MNIST uses")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise DataError(f"{path}: size does not match its header (truncated download?)")
    return data.reshape(dims)


_MNIST_HOW = ("Provide MNIST with mnist:PATH (e.g. --data mnist:PATH), PATH being an .npz with arrays X (N,28,28) "
              "and y (N,) (or Keras' mnist.npz), a folder with the IDX files train-images-idx3-ubyte[.gz], "
              "train-labels-idx1-ubyte[.gz] (and t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz] for "
              "the official test split) as published on Yann LeCun's MNIST page and its mirrors, or torchvision's "
              f"layout <root>/MNIST/raw/; or set ${DATA_ENV} to such a folder and pass plain 'mnist'.")


def _idx_file(folder: str, names: tuple[str, ...]) -> Optional[str]:
    for name in names:
        for suffix in ("", ".gz"):
            p = os.path.join(folder, name + suffix)
            if os.path.isfile(p):
                return p
    return None


_IDX = {"x": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
        "y": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
        "xt": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
        "yt": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte")}


def _find_mnist(path: str) -> Optional[tuple[str, str]]:
    """``("npz", file)`` or ``("idx", folder)`` for the MNIST data at ``path``, or None if none is there."""
    if os.path.isfile(path):
        return ("npz", path) if path.endswith(".npz") else None
    if not os.path.isdir(path):
        return None
    for name in ("mnist10k.npz", "mnist.npz"):
        if os.path.isfile(os.path.join(path, name)):
            return "npz", os.path.join(path, name)
    for folder in (path, os.path.join(path, "raw"), os.path.join(path, "MNIST", "raw")):
        if _idx_file(folder, _IDX["x"]) or _idx_file(folder, _IDX["y"]):
            return "idx", folder
    return None


def _load_mnist(kind: str, path: str) -> Arrays:
    if kind == "npz":
        with np.load(path) as z:
            if "x_train" in z and "y_train" in z and "x_test" in z and "y_test" in z:
                x, y, xt, yt = z["x_train"], z["y_train"], z["x_test"], z["y_test"]
            elif "X" in z and "y" in z:
                x, y, xt, yt = z["X"], z["y"], None, None
            else:
                raise DataError(f"{path} has arrays {sorted(z.files)}, not X and y. {_MNIST_HOW}")
    else:
        files = {k: _idx_file(path, v) for k, v in _IDX.items()}
        for k in ("x", "y"):
            if files[k] is None:
                raise DataError(f"no {_IDX[k][0]}[.gz] in {path}. {_MNIST_HOW}")
        x, y = _read_idx(files["x"]), _read_idx(files["y"])
        xt = yt = None
        if files["xt"] and files["yt"]:
            xt, yt = _read_idx(files["xt"]), _read_idx(files["yt"])
    out = []
    for images, labels in ((x, y), (xt, yt)):
        if images is None:
            out += [None, None]
            continue
        if len(images) != len(labels):
            raise DataError(f"MNIST at {path}: {len(images)} images but {len(labels)} labels")
        if images[0].size != 784:
            raise DataError(f"MNIST at {path}: images of {images[0].size} pixels, expected 28x28 = 784")
        out += [images.reshape(len(images), -1).astype(np.float32) / 255.0, labels.astype(np.int64)]
    return out[0], out[1], out[2], out[3]


def _search_roots() -> list[str]:
    roots = [r for r in os.environ.get(DATA_ENV, "").split(os.pathsep) if r]
    return [os.path.expanduser(r) for r in roots] + [os.path.expanduser(os.path.join("~", ".cache", "gradq"))]


def _from_path(path: str, find: Callable[[str], Any], load: Callable[[Any], Arrays], what: str, looked: str,
               how: str) -> Arrays:
    """Load from a path the user named: a clear error if it is missing or holds no such data."""
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise DataError(f"{path!r} does not exist. {how}")
    found = find(path)
    if found is None:
        raise DataError(f"no {what} in {path!r} (looked for {looked}). {how}")
    return load(found)


def _mnist(path: str) -> Arrays:
    if path:
        return _from_path(path, _find_mnist, lambda f: _load_mnist(*f),
                          "MNIST data",
                          ".npz files, IDX files, raw/ and MNIST/raw/", _MNIST_HOW)
    shared = os.path.join("..", "shared", "data", "mnist10k.npz")
    candidates = _search_roots() + [os.path.join(os.getcwd(), shared), str(REPO_ROOT / shared)]
    for cand in candidates:
        found = _find_mnist(cand)
        if found is not None:
            return _load_mnist(*found)
    raise DataError(f"'mnist' was given without a path and no MNIST data was found in "
                    f"{', '.join(os.path.normpath(c) for c in candidates)}. {_MNIST_HOW}")


_CIFAR_HOW = ("Get CIFAR-10 by downloading cifar-10-python.tar.gz (the python version, about 163 MB) from "
              "https://www.cs.toronto.edu/~kriz/cifar.html, extracting it (tar xzf cifar-10-python.tar.gz) and "
              "passing cifar10:PATH with PATH the cifar-10-batches-py folder, its parent, or the archive itself; "
              f"or put it under ${DATA_ENV} or ~/.cache/gradq and pass plain 'cifar10'.")
_CIFAR_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
_CIFAR_DIR = "cifar-10-batches-py"
_CIFAR_TAR = "cifar-10-python.tar.gz"


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, bytes and numpy arrays only: any other global is refused."""

    def find_class(self, module: str, name: str):
        core = getattr(np, "_core", None) or np.core
        allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype, ("_codecs", "encode"): codecs.encode}
        for pkg in ("numpy.core", "numpy._core"):  # numpy 1 and numpy 2 spell the module differently
            allowed[(pkg + ".multiarray", "_reconstruct")] = core.multiarray._reconstruct
            allowed[(pkg + ".multiarray", "scalar")] = core.multiarray.scalar
            allowed[(pkg + ".numeric", "_frombuffer")] = core.numeric._frombuffer  # pickle protocol 5
        if (module, name) in allowed:
            return allowed[(module, name)]
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: not part of a CIFAR-10 batch")


def _cifar_batch(raw: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        d = _ArrayUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise DataError(f"{where} is not a CIFAR-10 python batch ({e}). {_CIFAR_HOW}") from None
    if not isinstance(d, dict) or b"data" not in d or b"labels" not in d:
        raise DataError(f"{where} is not a CIFAR-10 python batch (no b'data' / b'labels'). {_CIFAR_HOW}")
    x = np.asarray(d[b"data"], dtype=np.uint8)
    y = np.asarray(d[b"labels"], dtype=np.int64)
    if x.ndim != 2 or x.shape[1] != 3072 or len(x) != len(y):
        raise DataError(f"{where}: data {x.shape} / {len(y)} labels; expected (N, 3072) uint8 and N labels")
    return x, y


def _find_cifar(path: str) -> Optional[str]:
    """The batches folder or archive for CIFAR-10 at ``path``, or None."""
    if os.path.isfile(path):
        return path if path.endswith((".tar.gz", ".tgz")) else None
    for cand in (path, os.path.join(path, _CIFAR_DIR)):
        if os.path.isfile(os.path.join(cand, "data_batch_1")):
            return cand
    tar = os.path.join(path, _CIFAR_TAR)
    return tar if os.path.isfile(tar) else None


def _load_cifar(source: str) -> Arrays:
    batches = []
    if os.path.isfile(source):
        try:
            with tarfile.open(source, "r:*") as tar:
                members = {os.path.basename(m.name): m for m in tar.getmembers() if m.isfile()}
                for name in _CIFAR_FILES:
                    if name not in members:
                        raise DataError(f"{source} has no {name}. {_CIFAR_HOW}")
                    batches.append(_cifar_batch(tar.extractfile(members[name]).read(), f"{source}:{name}"))
        except (tarfile.TarError, OSError, EOFError) as e:
            raise DataError(f"cannot read {source}: {e}. {_CIFAR_HOW}") from None
    else:
        missing = [n for n in _CIFAR_FILES if not os.path.isfile(os.path.join(source, n))]
        if missing:
            raise DataError(f"{source} lacks {', '.join(missing)} (incomplete extraction?). {_CIFAR_HOW}")
        for name in _CIFAR_FILES:
            with open(os.path.join(source, name), "rb") as f:
                batches.append(_cifar_batch(f.read(), os.path.join(source, name)))
    x = np.concatenate([b[0] for b in batches[:5]])
    y = np.concatenate([b[1] for b in batches[:5]])
    xt, yt = batches[5]
    return x.astype(np.float32) / 255.0, y, xt.astype(np.float32) / 255.0, yt


def _cifar_torchvision(root: str) -> Optional[Arrays]:
    try:
        from torchvision.datasets import CIFAR10
    except ImportError:
        return None
    try:
        tr, te = CIFAR10(root=root, train=True, download=False), CIFAR10(root=root, train=False, download=False)
    except (RuntimeError, OSError):
        return None

    def arr(d):  # torchvision keeps (N, 32, 32, 3); the batches are (N, 3, 32, 32)
        x = np.asarray(d.data, dtype=np.uint8).transpose(0, 3, 1, 2).reshape(len(d.data), -1)
        return x.astype(np.float32) / 255.0, np.asarray(d.targets, dtype=np.int64)
    return (*arr(tr), *arr(te))


def _cifar10(path: str) -> Arrays:
    if path:
        return _from_path(path, _find_cifar, _load_cifar,
                          "CIFAR-10 batches",
                          f"data_batch_1, {_CIFAR_DIR}/ and {_CIFAR_TAR}", _CIFAR_HOW)
    roots = _search_roots()
    for source in filter(None, map(_find_cifar, roots)):
        return _load_cifar(source)
    for got in filter(None, map(_cifar_torchvision, roots)):
        return got
    raise DataError(f"'cifar10' was given without a path and no CIFAR-10 data was found in {', '.join(roots)}. "
                    f"{_CIFAR_HOW}")


#: keys of ``synthetic:KEY=VALUE,...`` and their defaults (``n`` and ``features`` default to
#: ``load_dataset``'s ``synthetic_size`` / ``synthetic_features``, 4000 and 64)
SYNTHETIC_DEFAULTS = {"n": 4000, "features": 64, "classes": 10, "hidden": 64, "noise": 0.0, "seed": 0}


def synthetic_task(n: int = 4000, features: int = 64, classes: int = 10, hidden: int = 64, noise: float = 0.0,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian inputs labelled by a fixed random teacher network.

    ``x ~ N(0, I)`` of shape ``(n, features)`` (float32). The teacher is a one-hidden-layer tanh network,
    ``logits = tanh(x W1 / sqrt(features)) W2 / sqrt(hidden) + b`` with standard normal ``W1`` (features x
    hidden) and ``W2`` (hidden x classes); ``hidden=0`` makes it linear (``x W2 / sqrt(features) + b``).
    ``b`` centres each class's logit over the sample so the classes come out roughly balanced. The label
    is the teacher's argmax; then a fraction ``noise`` of the labels is replaced by uniformly random
    classes. Everything is drawn from ``numpy.random.default_rng(seed)`` (default 0), so a spec always
    names the same task; ``load_dataset``'s ``seed`` only picks the train/test split.

    Defaults: n=4000, features=64, classes=10, hidden=64, noise=0.0, seed=0.
    """
    if n < 2 or features < 1 or classes < 2 or hidden < 0 or not 0.0 <= noise <= 1.0:
        raise DataError(f"synthetic: need n >= 2, features >= 1, classes >= 2, hidden >= 0 and 0 <= noise <= 1; "
                        f"got n={n}, features={features}, classes={classes}, hidden={hidden}, noise={noise}")
    rng = np.random.default_rng(seed)
    if hidden:
        w1 = rng.standard_normal((features, hidden), dtype=np.float32) / np.sqrt(features)
        w2 = rng.standard_normal((hidden, classes), dtype=np.float32) / np.sqrt(hidden)
    else:
        w2 = rng.standard_normal((features, classes), dtype=np.float32) / np.sqrt(features)
    x = rng.standard_normal((n, features), dtype=np.float32)
    logits = (np.tanh(x @ w1) if hidden else x) @ w2
    logits -= logits.mean(axis=0)
    y = logits.argmax(1).astype(np.int64)
    flip = rng.random(n) < noise
    y[flip] = rng.integers(0, classes, int(flip.sum()))
    return x, y


def _synthetic_params(arg: str, size: int, feats: int) -> dict:
    params = dict(SYNTHETIC_DEFAULTS, n=size, features=feats)
    for item in filter(None, (s.strip() for s in arg.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if key not in params or not eq:
            raise DataError(f"synthetic: bad parameter {item!r}; write synthetic:KEY=VALUE,... with keys "
                            + ", ".join(f"{k} (default {v})" for k, v in params.items()))
        try:
            params[key] = float(value) if key == "noise" else int(value)
        except ValueError:
            raise DataError(f"synthetic: {key}={value!r} is not a{' number' if key == 'noise' else 'n integer'}") \
                from None
    return params


def _synthetic_shape(features: int) -> tuple[int, int, int]:
    side = int(round(features ** 0.5))
    return (1, side, side) if side * side == features else (1, 1, features)


def _to_dataset(name: str, arrays: Arrays, image_shape: tuple[int, int, int], classes: Optional[int],
                test_fraction: float, seed: int, official_split: bool, standardize: bool) -> Dataset:
    x, y, xt, yt = arrays
    if xt is None or not official_split:
        if xt is not None:
            x, y = np.concatenate([x, xt]), np.concatenate([y, yt])
        if not 0.0 <= test_fraction < 1.0:
            raise DataError(f"test_fraction must be in [0, 1), got {test_fraction}")
        order = np.random.default_rng(seed).permutation(len(x))
        n_test = int(round(len(x) * test_fraction))
        te, tr = order[:n_test], order[n_test:]
        x, y, xt, yt = x[tr], y[tr], x[te], y[te]
    tensors = [torch.from_numpy(np.ascontiguousarray(a, dtype=dt))
               for a, dt in ((x, np.float32), (y, np.int64), (xt, np.float32), (yt, np.int64))]
    if standardize:
        mean, std = tensors[0].mean(0), tensors[0].std(0)
        std = torch.where(std > 1e-6, std, torch.ones_like(std))  # constant pixels stay as they are, centred
        tensors[0], tensors[2] = (tensors[0] - mean) / std, (tensors[2] - mean) / std
    return Dataset(name, *tensors, image_shape=image_shape, classes=classes)


def load_dataset(spec: str = "digits", *, test_fraction: float = 0.2, seed: int = 0,
                 synthetic_size: int = 4000, synthetic_features: int = 64, official_split: bool = True,
                 standardize: bool = False) -> Dataset:
    """Load a data set by spec: ``digits``, ``mnist[:PATH]``, ``cifar10[:PATH]`` or ``synthetic[:KEY=VALUE,...]``.

    See the module docstring for where each is read from. ``test_fraction`` (default 0.2) and ``seed``
    (default 0) make the random train/test split, used unless the data has an official split and
    ``official_split`` is True (the default). ``synthetic_size`` / ``synthetic_features`` (4000 / 64) are
    the defaults of the synthetic task's ``n`` / ``features``. ``standardize`` (default False) rescales
    each feature to zero mean and unit variance using the training split's statistics.
    Raises :class:`DataError` saying how to provide a missing or malformed data set.
    """
    name, _, arg = spec.partition(":")
    kw = dict(test_fraction=test_fraction, seed=seed, official_split=official_split, standardize=standardize)
    if name == "digits":
        return _to_dataset("digits", _digits(), (1, 8, 8), 10, **kw)
    if name == "mnist":
        return _to_dataset("mnist", _mnist(arg), (1, 28, 28), 10, **kw)
    if name in ("cifar10", "cifar-10"):
        return _to_dataset("cifar10", _cifar10(arg), (3, 32, 32), 10, **kw)
    if name == "synthetic":
        p = _synthetic_params(arg, synthetic_size, synthetic_features)
        x, y = synthetic_task(**p)
        return _to_dataset("synthetic", (x, y, None, None), _synthetic_shape(p["features"]), p["classes"], **kw)
    raise DataError(f"unknown data set {spec!r}; valid: digits, mnist[:PATH], cifar10[:PATH], "
                    "synthetic[:KEY=VALUE,...]")
