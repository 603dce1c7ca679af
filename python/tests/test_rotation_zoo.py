"""Tests of the RotationZoo .pt -> kvpool safetensors converter (python/kvpool_tools).

Every .pt input is written twice, once per writer (the ``writer`` parameter):
* "torch": a genuine ``torch.save`` file. Needs torch (pytest.importorskip: skipped where torch
  is missing, e.g. in CI); run it on a machine with PyTorch.
* "hand": torch's zip serialization layout built without torch (zip with <prefix>/data.pkl
  pickled at protocol 2 with persistent ids ("storage", torch.FloatStorage, key, "cpu", numel)
  rebuilt through torch._utils._rebuild_tensor_v2, <prefix>/data/<key> raw little-endian
  storages, <prefix>/byteorder, <prefix>/version), pickled with stand-in `torch` /
  `torch._utils` modules so the opcodes name exactly the globals torch writes.

The inputs follow the layout of the published OSCAR files (see the converter's docstring for
the reference code it was checked against): one file per kind, objectives
"qqt_r_h_pbr" / "sst_r_h_pbr", a "calibration" dict, int layer keys with a "layer_id" field,
float32 rotations R = U·H·P_br and ascending eigenvalues.

Run with pytest (``python3 -m pytest python/tests/test_rotation_zoo.py``) or, where pytest is
missing, as a plain script (``python3 python/tests/test_rotation_zoo.py``): it then runs every
test with the torch writer (and the hand-built one) using plain asserts and exits non-zero on
the first failure. numpy is needed either way (the converter uses it).
"""
import collections
import glob
import hashlib
import io
import json
import math
import os
import pathlib
import pickle
import re
import struct
import subprocess
import sys
import tempfile
import traceback
import types
import zipfile

import numpy as np

try:
    import pytest
except ImportError:  # plain-script mode (see __main__)
    pytest = None

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kvpool_tools import rotation_zoo as rz  # noqa: E402

WRITERS = ("hand", "torch")


class SkipTest(Exception):
    """Raised by skip() in plain-script mode."""


def skip(msg):
    if pytest is not None:
        pytest.skip(msg)
    raise SkipTest(msg)


class raises:  # noqa: N801 - mirrors pytest.raises(exc, match=...) without pytest
    def __init__(self, exc, match=None):
        self.exc, self.match = exc, match

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        assert et is not None, f"{self.exc.__name__} was not raised"
        if not issubclass(et, self.exc):
            return False
        assert self.match is None or re.search(self.match, str(ev)), (
            f"{et.__name__}({ev!s}) does not match {self.match!r}")
        return True


class StridedView:
    """A tensor pickled as a view (size, stride) of the flat storage `flat` (hand writer only):
    e.g. a stride-0 view of one element that claims 2^34 elements."""

    def __init__(self, flat, size, stride):
        self.flat, self.size, self.stride = flat, size, stride


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
        if isinstance(o, StridedView):  # any (size, stride) over a flat storage
            t = Tensor(np.asarray(o.flat, dtype=np.float32).reshape(-1))
            t.shape, t.stride = tuple(o.size), tuple(o.stride)
            return t
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


def save_pt(obj, path, writer):
    """Writes obj (numpy arrays as float32 tensors) as a .pt file with the given writer."""
    if writer == "torch":
        import torch

        def conv(o):
            if isinstance(o, np.ndarray):
                t = torch.from_numpy(np.ascontiguousarray(o, dtype=np.float32))
                if o.ndim == 2 and o.flags.f_contiguous and not o.flags.c_contiguous:
                    # keep the strided view: torch.save stores the transpose's storage
                    t = torch.from_numpy(np.ascontiguousarray(o.T, dtype=np.float32)).t()
                return t
            if isinstance(o, dict):
                return {k: conv(v) for k, v in o.items()}
            return o

        torch.save(conv(obj), str(path))
    else:
        assert writer == "hand", writer
        pathlib.Path(path).write_bytes(_torch_save_by_hand(obj))


def random_rotation(rng, d):
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return q.astype(np.float32)


def oscar_rotation(rng, d):
    """R = U·H·P_br of a random SPD target (FORMAT.md §1) and its ascending eigenvalues, the
    way the OSCAR fitter builds them (float64, saved as float32)."""
    a = rng.standard_normal((d, 4 * d)) * np.linspace(0.1, 3.0, d)[:, None]
    lam, u = np.linalg.eigh(a @ a.T / (4 * d))
    h = np.array([[(-1) ** bin(i & j).count("1") for j in range(d)] for i in range(d)],
                 dtype=np.float64) / math.sqrt(d)
    bits = int(math.log2(d))
    br = [int(format(i, f"0{bits}b")[::-1], 2) for i in range(d)]
    order = np.argsort(-lam, kind="stable")
    perm = np.empty(d, dtype=np.int64)
    perm[br] = order
    p = np.eye(d)[:, perm]
    return (u @ h @ p).astype(np.float32), lam.astype(np.float32)


def zoo(rng, layers, d, heads=None, version=1, objective="oscar", layer_ids=None):
    out = {"format_version": version, "objective": objective, "source_grouping": "layer",
           "layers": {}}
    for i in (layer_ids if layer_ids is not None else range(layers)):
        if heads is None:
            r = random_rotation(rng, d)
            e = np.sort(rng.random(d)).astype(np.float32)
        else:
            r = np.stack([random_rotation(rng, d) for _ in range(heads)])
            e = np.sort(rng.random((heads, d)), axis=1).astype(np.float32)
        out["layers"][i] = {"rotation": r, "eigenvalues": e}
    return out


def oscar_pair(rng, layers, d, layer_ids=None):
    """A K file and a V file laid out like OSCAR's k_rotation_qqt_r_h_pbr.pt /
    v_rotation_sst_r_h_pbr.pt."""
    ids = list(layer_ids) if layer_ids is not None else list(range(layers))
    files = []
    for objective in ("qqt_r_h_pbr", "sst_r_h_pbr"):
        f = {"format_version": 1, "objective": objective, "source_grouping": "layer",
             "calibration": {"generation_id": "0f" * 16, "model_path": "/models/m",
                             "model_revision": None, "tokens": 20000, "post_rope": True,
                             "accumulator_dtype": "float64", "created_at_unix": 1.7e9},
             "layers": {}}
        for lid in ids:
            r, lam = oscar_rotation(rng, d)
            f["layers"][lid] = {"layer_id": lid, "rotation": r, "eigenvalues": lam}
        files.append(f)
    return files[0], files[1]


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


def cxx_inspect(tmp_path, out):
    """Output of `kvpool rotations inspect` on the converted bytes, or None when not built."""
    exe = find_kvpool_bin()
    if exe is None:
        return None
    f = pathlib.Path(tmp_path) / "cxx_check.safetensors"
    f.write_bytes(out)
    r = subprocess.run([exe, "rotations", "inspect", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert hashlib.sha256(out).hexdigest() in r.stdout
    return r.stdout


if pytest is not None:
    @pytest.fixture(params=WRITERS)
    def writer(request):
        if request.param == "torch":
            pytest.importorskip("torch")
        return request.param


# ---- tests -----------------------------------------------------------------------------------

def test_per_layer_keys_and_values(tmp_path, writer):
    rng = np.random.default_rng(1)
    k, v = zoo(rng, 3, 16), zoo(rng, 3, 16)
    kp, vp = tmp_path / "k.pt", tmp_path / "v.pt"
    save_pt(k, kp, writer)
    save_pt(v, vp, writer)
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
    text = cxx_inspect(tmp_path, out)
    if text is None:
        skip("kvpool binary not built; C++ cross-check skipped")
    assert "head_dim 16, num_layers 3, num_kv_heads 4" in text


def test_oscar_zoo_pair_layout(tmp_path, writer):
    """Separate K / V files as OSCAR publishes them; R is kept as stored (rows times R)."""
    rng = np.random.default_rng(11)
    k, v = oscar_pair(rng, 2, 32)
    kp, vp = tmp_path / "k_rotation_qqt_r_h_pbr.pt", tmp_path / "v_rotation_sst_r_h_pbr.pt"
    save_pt(k, kp, writer)
    save_pt(v, vp, writer)
    lk, lv = rz.load_pt(str(kp)), rz.load_pt(str(vp))
    assert lk["calibration"]["tokens"] == 20000 and lk["calibration"]["model_revision"] is None
    assert lk["layers"][1]["layer_id"] == 1
    out = rz.convert(lk, lv, model_name="qwen3-8b", num_kv_heads=8)
    meta, arrays = read_safetensors(out)
    assert (meta["objective"], meta["composition"]) == ("oscar", "U*H*P_br")
    assert (meta["format_version"], meta["head_dim"], meta["num_layers"]) == ("1", "32", "2")
    assert "source_layer_ids" not in meta
    for i in range(2):
        for kind, src in (("k", k), ("v", v)):
            r = arrays[f"layers.{i}.{kind}.rotation"]
            np.testing.assert_array_equal(r, src["layers"][i]["rotation"])  # not transposed
            np.testing.assert_array_equal(arrays[f"layers.{i}.{kind}.eigenvalues"],
                                          src["layers"][i]["eigenvalues"])
            assert np.max(np.abs(r.astype(np.float64) @ r.T - np.eye(32))) < 1e-5
    text = cxx_inspect(tmp_path, out)
    if text is not None:
        assert "head_dim 32, num_layers 2, num_kv_heads 8" in text
    # Hadamard-only zoo files (objective "hadamard", eigenvalues all ones)
    h = zoo(rng, 2, 8, objective="hadamard")
    hp = tmp_path / "k_rotation_hadamard.pt"
    save_pt(h, hp, writer)
    meta, _ = read_safetensors(rz.convert(rz.load_pt(str(hp)), rz.load_pt(str(hp)),
                                          model_name="m", num_kv_heads=1))
    assert (meta["objective"], meta["composition"]) == ("hadamard", "H")
    # other targets / compositions are named, never silently called OSCAR
    a, b = zoo(rng, 1, 8, objective="ktk_plain"), zoo(rng, 1, 8, objective="vtv_plain")
    meta, _ = read_safetensors(rz.convert(a, b, model_name="m", num_kv_heads=1))
    assert (meta["objective"], meta["composition"]) == ("k:ktk_plain,v:vtv_plain", "U")
    with raises(rz.ConversionError, match="different compositions"):
        rz.convert(zoo(rng, 1, 8, objective="qqt_r_h_pbr"), zoo(rng, 1, 8, objective="sst_r_h"),
                   model_name="m", num_kv_heads=1)


def test_swapped_key_and_value_files_are_refused_naming_the_objective(tmp_path, writer):
    """Newcomer report 9 A6: --keys v_*.pt --values k_*.pt converted silently (objective
    recorded as k:sst_r_h_pbr,v:qqt_r_h_pbr, keys rotated with the value rotations)."""
    rng = np.random.default_rng(12)
    k, v = oscar_pair(rng, 2, 8)
    with raises(rz.ConversionError, match=r"--keys file's objective 'sst_r_h_pbr' is a value "
                                          r"rotation.*--values file's objective 'qqt_r_h_pbr' "
                                          r"is a key rotation.*swapped"):
        rz.convert(v, k, model_name="m", num_kv_heads=1)
    # one side alone is enough (a key file twice, a value file twice)
    with raises(rz.ConversionError, match=r"--values file's objective 'qqt_r_h_pbr'"):
        rz.convert(k, k, model_name="m", num_kv_heads=1)
    with raises(rz.ConversionError, match=r"--keys file's objective 'sst_r_h_pbr'"):
        rz.convert(v, v, model_name="m", num_kv_heads=1)
    kvtv = zoo(rng, 1, 8, objective="vtv_plain")
    with raises(rz.ConversionError, match=r"'vtv' = value target"):
        rz.convert(kvtv, zoo(rng, 1, 8, objective="ktk_plain"), model_name="m", num_kv_heads=1)
    # the right order and kind-agnostic objectives still convert
    assert rz.convert(k, v, model_name="m", num_kv_heads=1)
    assert rz.convert(zoo(rng, 2, 8, objective="oscar"), v, model_name="m", num_kv_heads=1)
    # the CLI: exit 2 with one "rotation_zoo: ..." line, nothing written
    kp, vp = tmp_path / "k_rotation_qqt_r_h_pbr.pt", tmp_path / "v_rotation_sst_r_h_pbr.pt"
    save_pt(k, kp, writer)
    save_pt(v, vp, writer)
    out = tmp_path / "zoo3.st"
    r = subprocess.run([sys.executable, "-m", "kvpool_tools.rotation_zoo", "--keys", str(vp),
                        "--values", str(kp), "--out", str(out), "--model-name", "m",
                        "--num-kv-heads", "4"], capture_output=True, text=True,
                       cwd=os.path.join(os.path.dirname(__file__), ".."), timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.startswith("rotation_zoo: ") and "Traceback" not in r.stderr, r.stderr
    assert "objective 'sst_r_h_pbr'" in r.stderr and "swapped" in r.stderr, r.stderr
    assert not out.exists()


def test_sparse_global_layer_ids(tmp_path, writer):
    """Hybrid models key only their attention layers by global id (3, 7, 11, ...)."""
    rng = np.random.default_rng(12)
    k, v = oscar_pair(rng, 3, 8, layer_ids=[3, 7, 11])
    kp, vp = tmp_path / "k.pt", tmp_path / "v.pt"
    save_pt(k, kp, writer)
    save_pt(v, vp, writer)
    lk, lv = rz.load_pt(str(kp)), rz.load_pt(str(vp))
    with raises(rz.ConversionError, match=r"layer ids \[3, 7, 11\] are not 0..2"):
        rz.convert(lk, lv, model_name="m", num_kv_heads=2)
    out = rz.convert(lk, lv, model_name="m", num_kv_heads=2, renumber_layers=True)
    meta, arrays = read_safetensors(out)
    assert meta["num_layers"] == "3" and meta["source_layer_ids"] == "3,7,11"
    np.testing.assert_array_equal(arrays["layers.1.v.rotation"], v["layers"][7]["rotation"])
    # a K and a V file covering different layers, and a layer_id field contradicting its key
    v2 = dict(v, layers={lid: e for lid, e in v["layers"].items() if lid != 11})
    with raises(rz.ConversionError, match="values file"):
        rz.convert(lk, v2, model_name="m", num_kv_heads=2, renumber_layers=True)
    bad = dict(k, layers=dict(k["layers"]))
    bad["layers"][3] = dict(k["layers"][3], layer_id=4)
    with raises(rz.ConversionError, match="layer key 3 holds layer_id 4"):
        rz.convert(bad, v, model_name="m", num_kv_heads=2, renumber_layers=True)


def test_per_head_and_combined_kinds(tmp_path, writer):
    rng = np.random.default_rng(2)
    kk, vv = zoo(rng, 2, 8, heads=2, version=2), zoo(rng, 2, 8, heads=2, version=2)
    both = {"format_version": 2, "objective": "oscar", "source_grouping": "head",
            "layers": {i: {"k": kk["layers"][i], "v": vv["layers"][i]} for i in range(2)}}
    p = tmp_path / "both.pt"
    save_pt(both, p, writer)
    out = rz.convert(rz.load_pt(str(p)), None, model_name="m", num_kv_heads=None)
    meta, arrays = read_safetensors(out)
    assert meta["format_version"] == "2" and meta["num_kv_heads"] == "2"
    assert arrays["layers.1.v.rotation"].shape == (2, 8, 8)
    np.testing.assert_array_equal(arrays["layers.1.v.rotation"], vv["layers"][1]["rotation"])
    with raises(rz.ConversionError, match="num-kv-heads 3"):
        rz.convert(rz.load_pt(str(p)), None, model_name="m", num_kv_heads=3)
    # per-head tensors decide, as in OSCAR's loader, even when format_version says 1
    kk1 = dict(kk, format_version=1)
    meta, _ = read_safetensors(rz.convert(kk1, dict(vv, format_version=1), model_name="m",
                                          num_kv_heads=None))
    assert meta["format_version"] == "2"
    # mixed ranks and a per-head claim with [d, d] tensors are refused
    with raises(rz.ConversionError, match="mixed"):
        rz.convert(kk, zoo(rng, 2, 8), model_name="m", num_kv_heads=2)
    with raises(rz.ConversionError, match="format_version 2"):
        rz.convert(zoo(rng, 2, 8, version=2), zoo(rng, 2, 8), model_name="m", num_kv_heads=2)


def test_strided_tensor_view(tmp_path, writer):
    rng = np.random.default_rng(3)
    r = np.asfortranarray(random_rotation(rng, 8))  # pickled as a strided (transposed) view
    obj = {"format_version": 1, "layers": {0: {"rotation": r}}}
    p = tmp_path / "s.pt"
    save_pt(obj, p, writer)
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
    with raises(pickle.UnpicklingError, match="is not allowed"):
        rz.load_pt(z.getvalue())
    with raises(rz.ConversionError, match="not a torch zip"):
        rz.load_pt(b"not a zip")
    rng = np.random.default_rng(4)
    bad = zoo(rng, 1, 12)
    with raises(rz.ConversionError, match="power of two"):
        rz.convert(bad, bad, model_name="m", num_kv_heads=1)
    one = zoo(rng, 1, 8)
    with raises(rz.ConversionError, match="num-kv-heads is required"):
        rz.convert(one, one, model_name="m", num_kv_heads=None)
    with raises(rz.ConversionError, match="give --values"):
        rz.convert(one, None, model_name="m", num_kv_heads=1)
    skew = zoo(rng, 1, 8)
    skew["layers"][0]["rotation"] = skew["layers"][0]["rotation"] * 1.01
    with raises(rz.ConversionError, match=r"layer 0 k rotation is not orthogonal"):
        rz.convert(skew, one, model_name="m", num_kv_heads=1)
    with raises(rz.ConversionError, match="format_version 3"):
        rz.convert(dict(one, format_version=3), one, model_name="m", num_kv_heads=1)


def test_cli(tmp_path, writer):
    rng = np.random.default_rng(5)
    k, v = oscar_pair(rng, 2, 8, layer_ids=[1, 5])
    kp, vp = tmp_path / "k.pt", tmp_path / "v.pt"
    save_pt(k, kp, writer)
    save_pt(v, vp, writer)
    out = tmp_path / "o.safetensors"
    base = ["--keys", str(kp), "--values", str(vp), "--out", str(out), "--model-name", "m",
            "--num-kv-heads", "4"]
    assert rz.main(base) == 2 and not out.exists()  # sparse ids need --renumber-layers
    assert rz.main(base + ["--renumber-layers"]) == 0 and out.exists()
    meta, _ = read_safetensors(out.read_bytes())
    src = hashlib.sha256(kp.read_bytes() + vp.read_bytes()).hexdigest()
    assert meta["source_hash"] == "sha256:" + src and meta["source_layer_ids"] == "1,5"
    assert rz.main(["--keys", str(tmp_path / "missing.pt"), "--out", str(out),
                    "--model-name", "m"]) == 2


# ---- malformed inputs: "rotation_zoo: ..." and exit 2, never a traceback ----------------------

def _cli(tmp_path, keys_obj, *extra, out=None):
    """Runs the CLI on keys_obj (hand-written .pt); returns (rc, stderr, out path)."""
    kp = tmp_path / "k.pt"
    save_pt(keys_obj, kp, "hand")
    out = out or tmp_path / "o.safetensors"
    r = subprocess.run([sys.executable, "-m", "kvpool_tools.rotation_zoo", "--keys", str(kp),
                        "--out", str(out), "--model-name", "m", *extra],
                       capture_output=True, text=True,
                       cwd=os.path.join(os.path.dirname(__file__), ".."), timeout=120)
    return r.returncode, r.stderr, out


def test_malformed_fields_are_conversion_errors(tmp_path):
    rng = np.random.default_rng(6)
    r = random_rotation(rng, 8)
    both = {"k": {"rotation": r}, "v": {"rotation": r}}
    cases = [
        ({"format_version": "abc", "layers": {0: both}}, r"format_version 'abc' is not an integer"),
        ({"format_version": None, "layers": {0: both}}, r"format_version None is not an integer"),
        ({"layers": {0: dict(both, layer_id="zero")}}, r"layer 0 layer_id 'zero' is not an integer"),
        ({"layers": {"x": both}}, r"layer key 'x' is not an integer"),
        ({"layers": {0: {"k": {"rotation": "hello"}, "v": {"rotation": r}}}},
         r"layer 0 k rotation is a str, not a numeric tensor"),
        ({"layers": {0: {"k": {"rotation": r, "eigenvalues": "e"}, "v": {"rotation": r}}}},
         r"layer 0 k eigenvalues is a str, not a numeric tensor"),
        ({"layers": {0: {"k": "nope", "v": {"rotation": r}}}}, r"layer 0 k: no 'rotation'"),
    ]
    for obj, match in cases:
        p = tmp_path / "bad.pt"
        save_pt(obj, p, "hand")
        with raises(rz.ConversionError, match=match):
            rz.convert(rz.load_pt(str(p)), None, model_name="m", num_kv_heads=1)
        rc, err, out = _cli(tmp_path, obj, "--num-kv-heads", "1")
        assert rc == 2, (rc, err)
        assert err.startswith("rotation_zoo: ") and "Traceback" not in err, err
        assert re.search(match, err), err
        assert not out.exists()


def test_sizes_are_bounded_before_materializing(tmp_path):
    # 629 bytes of .pt whose stride-0 views claim 2^17 x 2^17 float32 (64 GiB) each.
    one = np.ones(1, np.float32)
    bomb = {"layers": {0: {"k": {"rotation": StridedView(one, (1 << 17, 1 << 17), (0, 0))},
                           "v": {"rotation": StridedView(one, (1 << 17, 1 << 17), (0, 0))}}}}
    p = tmp_path / "bomb.pt"
    save_pt(bomb, p, "hand")
    assert p.stat().st_size < 4096
    with raises(rz.ConversionError, match=r"17179869184 elements, more than the 67108864"):
        rz.load_pt(str(p))
    # Each view within the per-tensor bound, together above the file's 256 MiB.
    many = {"layers": {i: {"rotation": StridedView(one, (4096, 4096), (0, 0))}
                       for i in range(5)}}
    save_pt(many, p, "hand")
    with raises(rz.ConversionError, match=r"tensors hold more than the 67108864"):
        rz.load_pt(str(p))
    # Rank and negative sizes are refused too (shape checks come before np.prod).
    save_pt({"layers": {0: {"rotation": StridedView(one, (1, 1, 1, 1), (0, 0, 0, 0))}}}, p, "hand")
    with raises(rz.ConversionError, match=r"rank 1..3"):
        rz.load_pt(str(p))
    rc, err, _ = _cli(tmp_path, bomb, "--num-kv-heads", "1")
    assert rc == 2 and "more than the 67108864" in err and "Traceback" not in err, err


def test_cli_flag_values_are_checked(tmp_path):
    rng = np.random.default_rng(7)
    one = zoo(rng, 1, 8)
    obj = {"format_version": 1, "layers": {0: {"k": one["layers"][0], "v": one["layers"][0]}}}
    for extra, match in ((["--clip-k", "nan"], r"--clip-k: must be 0 \(disabled\) or in"),
                         (["--clip-v", "inf"], r"--clip-v: must be 0"),
                         (["--clip-k", "1.5"], r"--clip-k: must be 0"),
                         (["--clip-k", "-0.1"], r"--clip-k: must be 0"),
                         (["--num-kv-heads", "0"], r"--num-kv-heads: must be >= 1, got 0"),
                         (["--num-kv-heads", "-3"], r"--num-kv-heads: must be >= 1, got -3")):
        args = extra if "--num-kv-heads" in extra else extra + ["--num-kv-heads", "1"]
        rc, err, out = _cli(tmp_path, obj, *args)
        assert rc == 2 and re.search(match, err), (extra, rc, err)
        assert not out.exists()
    # convert() itself refuses them as well (callers that skip the CLI).
    with raises(rz.ConversionError, match="--clip-k must be 0"):
        rz.convert(one, one, model_name="m", num_kv_heads=1, clip_k=float("nan"))
    # A positive ratio that is 0 as float32 would disable clipping silently (newcomer report 13b).
    with raises(rz.ConversionError, match="--clip-v 1e-50 is positive but rounds to 0"):
        rz.convert(one, one, model_name="m", num_kv_heads=1, clip_v=1e-50)
    with raises(rz.ConversionError, match="--num-kv-heads must be >= 1, got 0"):
        rz.convert(one, one, model_name="m", num_kv_heads=0)


def test_cli_output_is_checked_first_and_written_atomically(tmp_path):
    rng = np.random.default_rng(8)
    one = zoo(rng, 1, 8)
    obj = {"format_version": 1, "layers": {0: {"k": one["layers"][0], "v": one["layers"][0]}}}
    for out, match in ((tmp_path, r"is a directory; name a file"),
                       (tmp_path / "no" / "o.st", r"directory '.*/no' of '.*' does not exist"),
                       (pathlib.Path("/proc/o.st"), r"cannot create a file in directory '/proc'")):
        rc, err, _ = _cli(tmp_path, obj, "--num-kv-heads", "1", out=out)
        assert rc == 2 and re.search(match, err) and "Traceback" not in err, (out, err)
    # The old file survives a failed conversion; a good one replaces it with no temporary left.
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"old")
    rc, err, _ = _cli(tmp_path, {"format_version": "abc", "layers": {}}, "--num-kv-heads", "1")
    assert rc == 2 and out.read_bytes() == b"old", err
    rc, err, _ = _cli(tmp_path, obj, "--num-kv-heads", "1")
    assert rc == 0, err
    meta, _ = read_safetensors(out.read_bytes())
    assert meta["num_kv_heads"] == "1"
    assert not list(tmp_path.glob("o.safetensors.tmp-*")) and not list(tmp_path.glob(".rotation_zoo-probe-*"))


def test_cli_refuses_non_regular_inputs(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for keys in (str(fifo), "/dev/zero", str(tmp_path)):
        r = subprocess.run([sys.executable, "-m", "kvpool_tools.rotation_zoo", "--keys", keys,
                            "--out", str(tmp_path / "o.st"), "--model-name", "m"],
                           capture_output=True, text=True, timeout=60,
                           cwd=os.path.join(os.path.dirname(__file__), ".."))
        assert r.returncode == 2 and r.stderr.startswith("rotation_zoo: "), (keys, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr


# ---- plain-script runner (no pytest) ---------------------------------------------------------

def _run_as_script():
    try:
        import torch  # noqa: F401
        writers = ["torch", "hand"]
    except ImportError:
        print("torch is not importable: running the hand-built-layout tests only "
              "(the torch.save tests need PyTorch)")
        writers = ["hand"]
    tests = [(n, f) for n, f in sorted(globals().items())
             if n.startswith("test_") and callable(f)]
    passed = skipped = 0
    for name, fn in tests:
        params = fn.__code__.co_varnames[:fn.__code__.co_argcount]
        for w in (writers if "writer" in params else [None]):
            label = f"{name}[{w}]" if w else name
            kwargs = {"tmp_path": pathlib.Path(tempfile.mkdtemp(prefix="rz_"))}
            if w:
                kwargs["writer"] = w
            try:
                fn(**kwargs)
                passed += 1
                print(f"PASS {label}")
            except SkipTest as e:
                skipped += 1
                print(f"SKIP {label}: {e}")
            except Exception:  # noqa: BLE001 - report and fail
                print(f"FAIL {label}")
                traceback.print_exc()
                return 1
    print(f"{passed} passed, {skipped} skipped (writers: {', '.join(writers)})")
    return 0


if __name__ == "__main__":
    sys.exit(_run_as_script())
