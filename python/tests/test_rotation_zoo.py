"""Tests of the RotationZoo .pt -> kvpool safetensors converter (python/kvpool_tools).

The .pt inputs are genuine torch.save zip files: written with torch.save when torch is
importable, otherwise built by hand following torch's serialization layout (zip with
<prefix>/data.pkl pickled at protocol 2 with persistent ids ("storage", torch.FloatStorage,
key, "cpu", numel) rebuilt through torch._utils._rebuild_tensor_v2, <prefix>/data/<key> raw
little-endian storages, <prefix>/byteorder, <prefix>/version). The hand-built path pickles with
stand-in `torch` / `torch._utils` modules so the opcodes name exactly the globals torch writes.
"""
import collections
import glob
import hashlib
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import types
import zipfile

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kvpool_tools import rotation_zoo as rz  # noqa: E402

try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False

WRITER = "torch.save" if HAVE_TORCH else "hand-built torch zip layout"


def _torch_save_by_hand(obj):
    """torch.save's zip layout without torch: numpy arrays become persistent storages."""
    fake_torch = types.ModuleType("torch")
    fake_utils = types.ModuleType("torch._utils")

    class FloatStorage:  # the legacy storage class torch pickles as the storage type
        pass

    FloatStorage.__module__ = "torch"
    FloatStorage.__qualname__ = "FloatStorage"

    def _rebuild_tensor_v2(*args):  # never called while pickling
        raise AssertionError

    _rebuild_tensor_v2.__module__ = "torch._utils"
    _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
    fake_torch.FloatStorage = FloatStorage
    fake_torch._utils = fake_utils
    fake_utils._rebuild_tensor_v2 = _rebuild_tensor_v2

    storages = []

    class Storage:
        def __init__(self, flat):
            self.flat = flat
            self.key = str(len(storages))
            storages.append(self)

    class Tensor:
        def __init__(self, arr, transpose=False):
            arr = np.asarray(arr, dtype=np.float32)
            if transpose:  # store the transpose's buffer and describe a strided view of it
                base = np.ascontiguousarray(arr.T)
                self.storage = Storage(base.reshape(-1))
                self.shape = arr.shape
                self.stride = (1, arr.shape[0])
            else:
                self.storage = Storage(np.ascontiguousarray(arr).reshape(-1))
                self.shape = arr.shape
                self.stride = tuple(
                    int(np.prod(arr.shape[i + 1:])) for i in range(arr.ndim))

        def __reduce_ex__(self, protocol):
            return (_rebuild_tensor_v2, (self.storage, 0, tuple(self.shape), self.stride, False,
                                         collections.OrderedDict()))

    def wrap(o):
        if isinstance(o, np.ndarray):
            return Tensor(o, transpose=(o.ndim == 2 and o.shape[0] > 1 and o.flags.f_contiguous
                                        and not o.flags.c_contiguous))
        if isinstance(o, dict):
            return {k: wrap(v) for k, v in o.items()}
        return o

    class Pickler(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, Storage):
                return ("storage", FloatStorage, o.key, "cpu", o.flat.size)
            return None

    saved = {k: sys.modules.get(k) for k in ("torch", "torch._utils")}
    sys.modules["torch"] = fake_torch
    sys.modules["torch._utils"] = fake_utils
    try:
        buf = io.BytesIO()
        Pickler(buf, protocol=2).dump(wrap(obj))
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", "little")
        for s in storages:
            z.writestr(f"archive/data/{s.key}", s.flat.astype("<f4").tobytes())
        z.writestr("archive/version", "3\n")
    return out.getvalue()


def save_pt(obj, path):
    if HAVE_TORCH:
        import torch as T

        def conv(o):
            if isinstance(o, np.ndarray):
                return T.from_numpy(np.array(o, dtype=np.float32))
            if isinstance(o, dict):
                return {k: conv(v) for k, v in o.items()}
            return o

        T.save(conv(obj), path)
    else:
        with open(path, "wb") as f:
            f.write(_torch_save_by_hand(obj))


def random_rotation(rng, d):
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return q.astype(np.float32)


def zoo(rng, layers, d, heads=None, version=1):
    out = {"format_version": version, "objective": "oscar", "source_grouping": "layer",
           "layers": {}}
    for i in range(layers):
        if heads is None:
            r = random_rotation(rng, d)
            e = np.sort(rng.random(d)).astype(np.float32)
        else:
            r = np.stack([random_rotation(rng, d) for _ in range(heads)])
            e = np.sort(rng.random((heads, d)), axis=1).astype(np.float32)
        out["layers"][i] = {"rotation": r, "eigenvalues": e}
    return out


def read_safetensors(b):
    (n,) = struct.unpack("<Q", b[:8])
    header = json.loads(b[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = b[8 + n:]
    arrays = {}
    for name, t in header.items():
        assert t["dtype"] == "F32"
        s, e = t["data_offsets"]
        arrays[name] = np.frombuffer(data[s:e], dtype="<f4").reshape(t["shape"])
    return meta, arrays


def find_kvpool_bin():
    env = os.environ.get("KVPOOL_BIN")
    if env and os.path.exists(env):
        return env
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    for c in sorted(glob.glob(os.path.join(root, "build*", "bin", "kvpool")) +
                    glob.glob(os.path.join(root, "build*", "*", "bin", "kvpool"))):
        if os.access(c, os.X_OK):
            return c
    return None


def test_writer_path_reported(capsys):
    # Makes the path that produced the .pt files visible in pytest -s / -rA output.
    print(f"RotationZoo .pt files written by: {WRITER}")
    assert WRITER in ("torch.save", "hand-built torch zip layout")


def test_per_layer_keys_and_values(tmp_path):
    rng = np.random.default_rng(1)
    k, v = zoo(rng, 3, 16), zoo(rng, 3, 16)
    kp, vp = tmp_path / "k.pt", tmp_path / "v.pt"
    save_pt(k, kp)
    save_pt(v, vp)
    lk, lv = rz.load_pt(str(kp)), rz.load_pt(str(vp))
    assert lk["format_version"] == 1 and lk["objective"] == "oscar"
    np.testing.assert_array_equal(lk["layers"][2]["rotation"], k["layers"][2]["rotation"])
    out = rz.convert(lk, lv, model_name="m", num_kv_heads=4, source_hash="x")
    meta, arrays = read_safetensors(out)
    assert meta == {"format": "kvpool-rotations", "format_version": "1", "objective": "oscar",
                    "composition": "U*H*P_br", "model_name": "m", "head_dim": "16",
                    "num_layers": "3", "num_kv_heads": "4", "clip_ratio_k": "0.96",
                    "clip_ratio_v": "0.92", "source_hash": "x"}
    for i in range(3):
        np.testing.assert_array_equal(arrays[f"layers.{i}.k.rotation"], k["layers"][i]["rotation"])
        np.testing.assert_array_equal(arrays[f"layers.{i}.v.rotation"], v["layers"][i]["rotation"])
        np.testing.assert_array_equal(arrays[f"layers.{i}.v.eigenvalues"],
                                      v["layers"][i]["eigenvalues"])
    # deterministic
    assert out == rz.convert(rz.load_pt(str(kp)), rz.load_pt(str(vp)), model_name="m",
                             num_kv_heads=4, source_hash="x")
    # the C++ reader accepts it and reports the same rotation id (when the CLI is built)
    exe = find_kvpool_bin()
    if exe is None:
        pytest.skip("kvpool binary not built; C++ cross-check skipped")
    f = tmp_path / "rot.safetensors"
    f.write_bytes(out)
    r = subprocess.run([exe, "rotations", "inspect", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert hashlib.sha256(out).hexdigest() in r.stdout
    assert "head_dim 16, num_layers 3, num_kv_heads 4" in r.stdout


def test_per_head_and_combined_kinds(tmp_path):
    rng = np.random.default_rng(2)
    kk, vv = zoo(rng, 2, 8, heads=2, version=2), zoo(rng, 2, 8, heads=2, version=2)
    both = {"format_version": 2, "objective": "oscar", "source_grouping": "head",
            "layers": {i: {"k": kk["layers"][i], "v": vv["layers"][i]} for i in range(2)}}
    p = tmp_path / "both.pt"
    save_pt(both, p)
    out = rz.convert(rz.load_pt(str(p)), None, model_name="m", num_kv_heads=None)
    meta, arrays = read_safetensors(out)
    assert meta["format_version"] == "2" and meta["num_kv_heads"] == "2"
    assert arrays["layers.1.v.rotation"].shape == (2, 8, 8)
    np.testing.assert_array_equal(arrays["layers.1.v.rotation"], vv["layers"][1]["rotation"])
    with pytest.raises(rz.ConversionError, match="num-kv-heads 3"):
        rz.convert(rz.load_pt(str(p)), None, model_name="m", num_kv_heads=3)


@pytest.mark.skipif(HAVE_TORCH, reason="hand-built layout only")
def test_strided_tensor_view(tmp_path):
    rng = np.random.default_rng(3)
    r = np.asfortranarray(random_rotation(rng, 8))  # pickled as a strided view
    obj = {"format_version": 1, "layers": {0: {"rotation": r}}}
    p = tmp_path / "s.pt"
    p.write_bytes(_torch_save_by_hand(obj))
    got = rz.load_pt(str(p))["layers"][0]["rotation"]
    np.testing.assert_array_equal(got, r)


def test_refuses_foreign_globals_and_bad_files(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    buf = io.BytesIO()
    pickle.Pickler(buf, protocol=2).dump({"layers": Evil()})
    z = io.BytesIO()
    with zipfile.ZipFile(z, "w") as f:
        f.writestr("archive/data.pkl", buf.getvalue())
    with pytest.raises(pickle.UnpicklingError, match="is not allowed"):
        rz.load_pt(z.getvalue())
    with pytest.raises(rz.ConversionError, match="not a torch zip"):
        rz.load_pt(b"not a zip")
    rng = np.random.default_rng(4)
    bad = zoo(rng, 1, 12)
    with pytest.raises(rz.ConversionError, match="power of two"):
        rz.convert(bad, bad, model_name="m", num_kv_heads=1)
    one = zoo(rng, 1, 8)
    with pytest.raises(rz.ConversionError, match="num-kv-heads is required"):
        rz.convert(one, one, model_name="m", num_kv_heads=None)
    with pytest.raises(rz.ConversionError, match="give --values"):
        rz.convert(one, None, model_name="m", num_kv_heads=1)


def test_cli(tmp_path):
    rng = np.random.default_rng(5)
    kp = tmp_path / "k.pt"
    save_pt(zoo(rng, 2, 8), kp)
    out = tmp_path / "o.safetensors"
    rc = rz.main(["--keys", str(kp), "--values", str(kp), "--out", str(out), "--model-name", "m",
                  "--num-kv-heads", "4"])
    assert rc == 0 and out.exists()
    assert rz.main(["--keys", str(tmp_path / "missing.pt"), "--out", str(out),
                    "--model-name", "m"]) == 2
