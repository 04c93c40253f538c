"""Data loaders: embedded digits, MNIST (.npz, IDX, torchvision layout, auto-discovery), CIFAR-10 python
batches, the synthetic teacher-student task, and clear errors."""

from __future__ import annotations

import gzip
import os
import pickle
import struct
import tarfile

import numpy as np
import pytest
import torch

from gradq.train import data as data_mod
from gradq.train.data import DataError, load_dataset, synthetic_task

SHARED_MNIST = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "mnist10k.npz")


@pytest.fixture
def no_search_paths(tmp_path, monkeypatch):
    """Nothing to auto-discover: empty $GRADQ_DATA and home, current dir and checkout in an empty folder."""
    empty = tmp_path / "empty" / "a" / "b"
    empty.mkdir(parents=True)
    monkeypatch.setenv("GRADQ_DATA", str(empty))
    monkeypatch.setenv("HOME", str(empty))
    monkeypatch.chdir(empty)
    monkeypatch.setattr(data_mod, "REPO_ROOT", empty)
    return empty


def test_digits_split_is_fixed_and_scaled():
    pytest.importorskip("sklearn")
    a = load_dataset("digits", seed=0)
    b = load_dataset("digits", seed=0)
    assert torch.equal(a.x_train, b.x_train) and a.num_features == 64 and a.num_classes == 10
    assert a.x_train.shape[0] + a.x_test.shape[0] == 1797 and a.image_shape == (1, 8, 8)
    assert float(a.x_train.min()) >= 0 and float(a.x_train.max()) <= 1
    assert a.x_train.dtype == torch.float32 and a.y_train.dtype == torch.int64


# ------------------------------------------------------------------------------------------------ MNIST


def _write_idx(path, arr, gz):
    head = struct.pack(">BBBB", 0, 0, 8, arr.ndim) + b"".join(struct.pack(">I", d) for d in arr.shape)
    opener = gzip.open if gz else open
    with opener(path, "wb") as f:
        f.write(head + arr.astype(np.uint8).tobytes())


def _fake_mnist(folder, n_train=50, n_test=0, gz=False, seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sfx = ".gz" if gz else ""
    x = rng.integers(0, 256, (n_train, 28, 28))
    _write_idx(folder / f"train-images-idx3-ubyte{sfx}", x, gz)
    _write_idx(folder / f"train-labels-idx1-ubyte{sfx}", np.arange(n_train) % 10, gz)
    if n_test:
        _write_idx(folder / f"t10k-images-idx3-ubyte{sfx}", rng.integers(0, 256, (n_test, 28, 28)), gz)
        _write_idx(folder / f"t10k-labels-idx1-ubyte{sfx}", np.arange(n_test) % 10, gz)
    return x


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_from_idx_files(tmp_path, gz):
    x = _fake_mnist(tmp_path, gz=gz)
    d = load_dataset(f"mnist:{tmp_path}", test_fraction=0.2)
    assert d.num_features == 784 and d.x_train.shape[0] == 40 and d.image_shape == (1, 28, 28)
    assert float(d.x_train.max()) <= 1.0 and d.num_classes == 10
    # every training row is one of the written images, scaled by 1/255
    rows = {tuple(r) for r in (x.reshape(50, -1) / 255.0).astype(np.float32)}
    assert all(tuple(r) in rows for r in d.x_train.numpy())


def test_mnist_idx_official_split(tmp_path):
    _fake_mnist(tmp_path, n_train=30, n_test=12)
    d = load_dataset(f"mnist:{tmp_path}", test_fraction=0.5)  # test_fraction is ignored: official split
    assert d.x_train.shape == (30, 784) and d.x_test.shape == (12, 784)
    r = load_dataset(f"mnist:{tmp_path}", test_fraction=0.5, official_split=False)
    assert r.x_train.shape[0] == 21 and r.x_test.shape[0] == 21


def test_mnist_torchvision_layout(tmp_path, monkeypatch):
    _fake_mnist(tmp_path / "MNIST" / "raw", n_train=20, n_test=5, gz=True)
    d = load_dataset(f"mnist:{tmp_path}")
    assert d.x_train.shape == (20, 784) and d.x_test.shape == (5, 784)
    # the same root found through $GRADQ_DATA with plain "mnist"
    monkeypatch.setenv("GRADQ_DATA", str(tmp_path))
    e = load_dataset("mnist")
    assert torch.equal(d.x_train, e.x_train) and torch.equal(d.y_test, e.y_test)


def test_mnist_from_npz(tmp_path):
    np.savez(tmp_path / "m.npz", X=np.zeros((10, 28, 28), np.uint8), y=np.arange(10))
    assert load_dataset(f"mnist:{tmp_path / 'm.npz'}").x_test.shape == (2, 784)
    np.savez(tmp_path / "mnist.npz", x_train=np.zeros((6, 28, 28), np.uint8), y_train=np.arange(6),
             x_test=np.full((3, 28, 28), 255, np.uint8), y_test=np.arange(3))
    d = load_dataset(f"mnist:{tmp_path}")  # a folder holding mnist.npz (Keras' layout: official split)
    assert d.x_train.shape == (6, 784) and d.x_test.shape == (3, 784) and float(d.x_test.min()) == 1.0


@pytest.mark.skipif(not os.path.exists(SHARED_MNIST), reason="shared MNIST sample not present")
def test_shared_mnist_sample():
    d = load_dataset(f"mnist:{SHARED_MNIST}")
    assert d.x_train.shape[0] + d.x_test.shape[0] == 10000 and d.num_classes == 10
    assert d.x_test.shape[0] == 2000


def test_mnist_auto_discovery_of_shared_sample(monkeypatch, tmp_path):
    from gradq.train.data import REPO_ROOT
    if not (REPO_ROOT / ".." / "shared" / "data" / "mnist10k.npz").exists():
        pytest.skip("no ../shared/data/mnist10k.npz next to the checkout")
    monkeypatch.delenv("GRADQ_DATA", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # only the checkout-relative candidate can match
    d = load_dataset("mnist", seed=1)
    assert d.x_train.shape == (8000, 784) and d.image_shape == (1, 28, 28)


def test_mnist_not_found_says_how_to_provide_it(no_search_paths):
    with pytest.raises(DataError, match=r"mnist:PATH.*MNIST/raw") as err:
        load_dataset("mnist")
    assert "GRADQ_DATA" in str(err.value)
    with pytest.raises(DataError, match="without a path"):
        load_dataset("mnist:")


@pytest.mark.parametrize("spec,msg", [("mnist:/nonexistent/x.npz", "does not exist"),
                                      ("cifar10:/nonexistent/cifar", "does not exist.*cs.toronto.edu"),
                                      ("cifar", "valid: digits, mnist.*cifar10.*synthetic")])
def test_missing_data_says_how_to_provide_it(spec, msg):
    with pytest.raises(DataError, match=msg):
        load_dataset(spec)


def test_folder_without_data_is_explained(tmp_path):
    with pytest.raises(DataError, match="no MNIST data in .*MNIST/raw"):
        load_dataset(f"mnist:{tmp_path}")
    with pytest.raises(DataError, match="no CIFAR-10 batches in .*cifar-10-python.tar.gz"):
        load_dataset(f"cifar10:{tmp_path}")


def test_corrupt_idx_is_refused(tmp_path):
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\x01\x02junk")
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"\x01\x02junk")
    with pytest.raises(DataError, match="not an IDX file"):
        load_dataset(f"mnist:{tmp_path}")


def test_truncated_idx_is_refused(tmp_path):
    _fake_mnist(tmp_path, n_train=4)
    raw = (tmp_path / "train-images-idx3-ubyte").read_bytes()
    (tmp_path / "train-images-idx3-ubyte").write_bytes(raw[:-10])
    with pytest.raises(DataError, match="truncated"):
        load_dataset(f"mnist:{tmp_path}")


# ------------------------------------------------------------------------------------------------ CIFAR-10


def _fake_cifar(folder, per_batch=4, n_test=3, protocol=2, seed=0):
    """The python version's layout: pickled dicts with bytes keys, b'data' uint8 (N, 3072), b'labels'."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        n = n_test if name == "test_batch" else per_batch
        d = {b"batch_label": name.encode(), b"data": rng.integers(0, 256, (n, 3072)).astype(np.uint8),
             b"labels": [int(v) for v in rng.integers(0, 10, n)], b"filenames": [b"img.png"] * n}
        with open(folder / name, "wb") as f:
            pickle.dump(d, f, protocol=protocol)
        batches[name] = d
    return batches


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_cifar10_from_python_batches(tmp_path, protocol):
    batches = _fake_cifar(tmp_path / "cifar-10-batches-py", protocol=protocol)
    for path in (tmp_path / "cifar-10-batches-py", tmp_path):  # the folder itself or its parent
        d = load_dataset(f"cifar10:{path}")
        assert d.x_train.shape == (20, 3072) and d.x_test.shape == (3, 3072) and d.image_shape == (3, 32, 32)
        assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64 and d.num_classes == 10
        # official split, file order kept, channel-first rows as stored, scaled to [0, 1]
        first = torch.from_numpy(batches["data_batch_1"][b"data"][0].astype(np.float32) / 255)
        assert torch.equal(d.x_train[0], first)
        assert d.y_train[4:8].tolist() == batches["data_batch_2"][b"labels"]
        assert d.y_test.tolist() == batches["test_batch"][b"labels"]


def test_cifar10_from_archive_and_search_root(tmp_path, monkeypatch):
    _fake_cifar(tmp_path / "src" / "cifar-10-batches-py")
    root = tmp_path / "root"
    root.mkdir()
    with tarfile.open(root / "cifar-10-python.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "src" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    a = load_dataset(f"cifar10:{root / 'cifar-10-python.tar.gz'}")
    b = load_dataset(f"cifar10:{tmp_path / 'src'}")
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    monkeypatch.setenv("GRADQ_DATA", str(root))  # plain "cifar10" finds the archive in $GRADQ_DATA
    assert torch.equal(load_dataset("cifar10").x_test, b.x_test)
    r = load_dataset(f"cifar10:{tmp_path / 'src'}", official_split=False, test_fraction=0.5, seed=3)
    assert r.x_train.shape[0] + r.x_test.shape[0] == 23


def test_cifar10_not_found_says_where_to_get_it(no_search_paths):
    with pytest.raises(DataError, match=r"cifar-10-python.tar.gz.*cs.toronto.edu.*cifar10:PATH"):
        load_dataset("cifar10")


def test_cifar10_incomplete_or_hostile_batches_are_refused(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _fake_cifar(folder)
    (folder / "test_batch").unlink()
    with pytest.raises(DataError, match="lacks test_batch"):
        load_dataset(f"cifar10:{folder}")
    _fake_cifar(folder)
    target = tmp_path / "created-by-pickle"

    class Hostile:
        def __reduce__(self):
            return (os.mkdir, (str(target),))

    with open(folder / "data_batch_3", "wb") as f:
        pickle.dump({b"data": Hostile(), b"labels": []}, f)
    with pytest.raises(DataError, match="refusing to unpickle posix.mkdir|refusing to unpickle nt.mkdir"):
        load_dataset(f"cifar10:{folder}")
    assert not target.exists()


# ------------------------------------------------------------------------------------------------ synthetic


def test_synthetic_plain_and_old_keywords():
    d = load_dataset("synthetic", synthetic_size=500)
    assert d.num_features == 64 and d.x_train.shape[0] == 400 and d.image_shape == (1, 8, 8)
    assert d.num_classes == 10 and d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64


def test_synthetic_with_parameters():
    d = load_dataset("synthetic:n=1000,features=30,classes=4,hidden=16", test_fraction=0.25)
    assert d.x_train.shape == (750, 30) and d.x_test.shape == (250, 30)
    assert d.image_shape == (1, 1, 30) and d.num_classes == 4
    counts = np.bincount(torch.cat([d.y_train, d.y_test]).numpy(), minlength=4)
    assert counts.min() > 100  # centred teacher logits: no class starves (uniform would be 250 each)
    # the task is fixed by the spec; load_dataset's seed only changes the split
    a, b = load_dataset("synthetic:n=300", seed=0), load_dataset("synthetic:n=300", seed=1)
    key = lambda ds: sorted(map(tuple, torch.cat([ds.x_train, ds.x_test]).tolist()))  # noqa: E731
    assert key(a) == key(b) and not torch.equal(a.x_train, b.x_train)
    assert not torch.equal(load_dataset("synthetic:n=300,seed=1").x_train, a.x_train)


def test_synthetic_labels_follow_the_teacher():
    # hidden=0 is a linear teacher (argmax of affine scores), so the classes are linearly separable: a
    # least-squares one-vs-rest fit on 2000 samples in 10 dims must beat 80% (random labels would give
    # ~1/3 with 3 classes); label noise of 0.5 replaces half the labels, ~1/3 of those by the same class.
    x, y = synthetic_task(n=2000, features=10, classes=3, hidden=0, seed=0)
    xa = np.hstack([x, np.ones((len(x), 1), np.float32)])
    w, *_ = np.linalg.lstsq(xa, np.eye(3)[y], rcond=None)
    assert (xa @ w).argmax(1).__eq__(y).mean() > 0.8
    _, yn = synthetic_task(n=2000, features=10, classes=3, hidden=0, noise=0.5, seed=0)
    changed = (yn != y).mean()
    assert 0.25 < changed < 0.42  # expected 0.5 * 2/3 = 0.33; binomial sd ~0.01


@pytest.mark.parametrize("spec,msg", [("synthetic:size=10", "keys n \\(default"),
                                      ("synthetic:n=ten", "not an integer"),
                                      ("synthetic:noise=2", "0 <= noise <= 1")])
def test_synthetic_bad_parameters(spec, msg):
    with pytest.raises(DataError, match=msg):
        load_dataset(spec)


def test_standardize_uses_training_statistics():
    d = load_dataset("synthetic:n=2000,features=16", standardize=True)
    assert torch.allclose(d.x_train.mean(0), torch.zeros(16), atol=1e-4)  # float32 sums over 1600 rows
    assert torch.allclose(d.x_train.std(0), torch.ones(16), atol=1e-4)
    plain = load_dataset("synthetic:n=2000,features=16")
    assert not torch.equal(plain.x_train, d.x_train) and torch.equal(plain.y_test, d.y_test)
