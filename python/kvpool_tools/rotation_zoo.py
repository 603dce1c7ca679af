"""Convert OSCAR RotationZoo ``.pt`` rotation files to kvpool rotation files (FORMAT.md §4).

Layout of the published files, checked against the OSCAR reference code (FutureMLS-Lab/OSCAR;
read for understanding only, nothing copied):

* ``rotation/compute_kv_rotation.py`` (offline fitter; functions ``empty_result`` /
  ``add_layer`` and the save at the end of ``main``) and
  ``python/sglang/srt/mem_cache/oscar_calibration.py`` (online calibrator,
  ``_checkpoint_state``) write ONE FILE PER KIND: keys ``k_rotation_qqt_r_h_pbr.pt`` and values
  ``v_rotation_sst_r_h_pbr.pt`` (names fixed in ``oscar_rotation_paths.py``; the published zoo
  is ``rotation/OSCAR-RotationZoo/<model>/<setting>/{k_rotation_qqt_r_h_pbr,
  v_rotation_sst_r_h_pbr}.pt``). Each is a ``torch.save`` dict
  ``{"format_version": 1, "objective": "<target>_<composition>", "source_grouping": "layer",
  ["calibration": {...},] "layers": {layer_id: {"layer_id": layer_id, "rotation": R,
  "eigenvalues": λ}}}``; the objective names the target (``qqt`` = query-weighted key target,
  ``sst`` = attention-weighted value target, ``ktk``/``vtv``, ``hadamard``, ``uresidual``) and
  the composition in matrix-product order (``r_h_pbr`` = U·H·P_br, the default).
* ``rotation`` is float32 ``[d, d]`` (per layer) or ``[H_kv, d, d]`` (per KV head); the
  runtime loader (``load_oscar_rotations``) branches on the tensor's rank, not on
  ``format_version``, so this converter does the same. ``eigenvalues`` is float32 ``[d]``
  straight from ``torch.linalg.eigh`` (ascending; all ones for ``hadamard``).
* R is stored as is and applied to rows on the right: ``k_rot = k @ R_k``, queries
  ``q @ R_k``, the attention output rotated back with ``o @ R_vᵀ``
  (``python/sglang/QuantKernel/oscar_rotate_rows.py``) — the same convention as FORMAT.md §1,
  so no transpose is needed.
* Layer ids are GLOBAL layer ids (int keys): contiguous 0..L−1 for dense models, sparse for
  hybrid ones (only the full-attention layers, e.g. 3, 7, 11, …). kvpool files index layers
  0..L−1: sparse ids are refused unless ``--renumber-layers`` maps them in ascending order
  (metadata ``source_layer_ids`` keeps the originals).

A layer entry may also hold both kinds as ``{"k": {...}, "v": {...}}`` (or ``"key"`` /
``"value"``); otherwise give the key file and the value file separately.

torch is NOT needed: a ``.pt`` written by ``torch.save`` (zip format, torch >= 1.6) is a zip
holding ``<prefix>/data.pkl`` (a pickle whose tensors are persistent ids
``("storage", StorageType, key, location, numel)`` rebuilt by
``torch._utils._rebuild_tensor_v2``) and one raw little-endian file ``<prefix>/data/<key>`` per
storage. :func:`load_pt` reads it with a restricted unpickler that only resolves the handful of
globals tensors need and refuses everything else (no arbitrary code execution).

Output: safetensors with tensors ``layers.{i}.{k,v}.rotation`` and ``layers.{i}.{k,v}.eigenvalues``
(F32) and ``__metadata__`` exactly as the C++ writer (kernels/src/rotation_file.cc) lays it out:
JSON keys sorted, compact separators, header padded with spaces to 8 bytes, tensors in name
order — so the same rotations give the same bytes (and the same rotation id) from either side.
Rotations whose orthogonality error max|R·Rᵀ − I| exceeds 1e-4 are refused (the C++ reader
refuses them too).

Malformed input is refused with one ``rotation_zoo: ...`` line and exit 2, never a traceback:
key and value files given swapped (the ``--keys`` file's ``objective`` names a value target,
``sst_*``/``vtv_*``, or the ``--values`` file's a key target, ``qqt_*``/``ktk_*``: the message
names the field and the files), non-integer ``format_version`` / layer ids, a rotation or
eigenvalues entry that is not a numeric
tensor, and sizes beyond a rotation file's 256 MiB (checked from the pickled shapes BEFORE any
array is built, per tensor and for the whole file, so a stride-0 view cannot ask for gigabytes).
Inputs must be regular files up to 1 GiB; ``--out`` is checked before the work (a directory, a
missing directory, one where no file can be created) and written atomically (temporary file
beside it, fsync, ``os.replace``); ``--clip-k`` / ``--clip-v`` must be 0 or in (0, 1] (as
``kvpool calibrate``) and ``--num-kv-heads`` >= 1; argparse's own usage errors also exit 2.

Usage (from build/venv)::

    python -m kvpool_tools.rotation_zoo --keys k_rotation_qqt_r_h_pbr.pt \\
        --values v_rotation_sst_r_h_pbr.pt --out rot.safetensors \\
        --model-name qwen3-8b --num-kv-heads 8
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import io
import json
import math
import os
import pickle
import stat
import struct
import sys
import tempfile
import zipfile
from typing import Any, Dict, Optional, Tuple

import numpy as np

FORMAT_NAME = "kvpool-rotations"

_STORAGE_DTYPES = {
    "FloatStorage": np.float32,
    "DoubleStorage": np.float64,
    "HalfStorage": np.float16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
    "BFloat16Storage": "bfloat16",  # widened to float32 on load
}


class ConversionError(ValueError):
    """A malformed or unsupported input; the message names the problem."""


# Bounds checked before anything is materialized, so a tiny crafted file cannot ask for
# gigabytes (a stride-0 view of a 1-element storage describes any size). A kvpool rotation file
# is at most 256 MiB (the pool's limit, docs/OPERATIONS.md "Trust model"): no tensor, and not
# all tensors together, may hold more float32 elements than that.
MAX_ELEMENTS = (256 << 20) // 4
MAX_TENSOR_RANK = 3  # rotations [d, d] / [H_kv, d, d], eigenvalues [d] / [H_kv, d]
MAX_INPUT_BYTES = 1 << 30  # a .pt input (its rotations are bounded by MAX_ELEMENTS anyway)


def _int_field(value: Any, what: str) -> int:
    """An integer field of the .pt dict (format_version, layer_id); ConversionError otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ConversionError(f"{what} {value!r} is not an integer")
    return int(value)


class _StorageType:
    def __init__(self, name: str):
        self.name = name


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
    data, dtype_size = storage
    if (not isinstance(size, (tuple, list)) or not isinstance(stride, (tuple, list))
            or len(size) != len(stride) or not isinstance(storage_offset, int)
            or not all(isinstance(x, int) for x in (*size, *stride))):
        raise ConversionError(f"tensor view (offset {storage_offset!r}, size {size!r}, stride "
                              f"{stride!r}) is malformed")
    size = tuple(int(s) for s in size)
    stride = tuple(int(s) for s in stride)
    if len(size) > MAX_TENSOR_RANK or any(s < 0 for s in size):
        raise ConversionError(f"tensor of shape {size}: a rotation file holds tensors of rank "
                              f"1..{MAX_TENSOR_RANK} with non-negative sizes")
    numel = math.prod(size)  # exact (Python ints), checked before any allocation
    if numel > MAX_ELEMENTS:
        raise ConversionError(f"tensor of shape {size} has {numel} elements, more than the "
                              f"{MAX_ELEMENTS} float32 (256 MiB) a rotation file may hold")
    if numel == 0:
        return np.zeros(size, dtype=data.dtype)
    last = storage_offset + sum((s - 1) * st for s, st in zip(size, stride))
    if storage_offset < 0 or last >= data.size or any(st < 0 for st in stride):
        raise ConversionError(
            f"tensor view (offset {storage_offset}, size {size}, stride {stride}) lies outside "
            f"its storage of {data.size} elements")
    return np.lib.stride_tricks.as_strided(
        data[storage_offset:], shape=size,
        strides=tuple(st * data.itemsize for st in stride)).copy()


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only what torch tensors need; any other global is refused."""

    def __init__(self, file, storages):
        super().__init__(file)
        self._storages = storages
        self._elements_left = MAX_ELEMENTS  # over all tensors of the file

    def _rebuild(self, storage, storage_offset, size, *args, **kwargs):
        if (isinstance(size, (tuple, list)) and all(isinstance(x, int) and x >= 0 for x in size)
                and math.prod(size) <= MAX_ELEMENTS):  # a larger one: _rebuild_tensor_v2 says so
            self._elements_left -= math.prod(size)
            if self._elements_left < 0:
                raise ConversionError(f"the tensors hold more than the {MAX_ELEMENTS} float32 "
                                      "elements (256 MiB) a rotation file may hold")
        return _rebuild_tensor_v2(storage, storage_offset, size, *args, **kwargs)

    def find_class(self, module, name):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return self._rebuild
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in a rotation file")

    def persistent_load(self, pid):
        if not isinstance(pid, tuple) or len(pid) < 5 or pid[0] != "storage":
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r}")
        storage_type, key, _location, numel = pid[1], str(pid[2]), pid[3], int(pid[4])
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"unsupported storage type {storage_type!r}")
        return self._storages(key, storage_type.name, numel)


def load_pt(path_or_bytes) -> Any:
    """Loads a torch.save zip file without torch. Returns the object with numpy arrays."""
    data = path_or_bytes if isinstance(path_or_bytes, (bytes, bytearray)) else open(
        path_or_bytes, "rb").read()
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as e:
        raise ConversionError(f"not a torch zip file ({e}); legacy non-zip .pt files are not "
                              "supported: re-save them with torch >= 1.6") from e
    names = zf.namelist()
    pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
        raise ConversionError(f"expected one '<prefix>/data.pkl' in the zip, found {pkl}")
    prefix = pkl[0][: -len("data.pkl")]
    if zf.getinfo(pkl[0]).file_size > MAX_INPUT_BYTES:
        raise ConversionError(f"{pkl[0]} is {zf.getinfo(pkl[0]).file_size} bytes uncompressed")
    byteorder = prefix + "byteorder"
    if byteorder in names and zf.read(byteorder).strip() != b"little":
        raise ConversionError("big-endian tensor data is not supported")

    cache: Dict[str, Tuple[np.ndarray, int]] = {}

    def storage(key: str, type_name: str, numel: int):
        if key not in cache:
            entry = prefix + "data/" + key
            if entry not in names:
                raise ConversionError(f"storage '{entry}' missing from the zip")
            dt = _STORAGE_DTYPES[type_name]
            itemsize = 2 if dt == "bfloat16" else np.dtype(dt).itemsize
            if not 0 <= numel <= MAX_ELEMENTS:
                raise ConversionError(f"storage {key}: {numel} elements, more than the "
                                      f"{MAX_ELEMENTS} a rotation file may hold")
            # The declared uncompressed size, checked before inflating (a zip bomb).
            if zf.getinfo(entry).file_size != numel * itemsize:
                raise ConversionError(f"storage {key}: {zf.getinfo(entry).file_size} bytes in "
                                      f"the zip, pickle says {numel} x {itemsize}")
            raw = zf.read(entry)
            if dt == "bfloat16":
                if len(raw) != 2 * numel:
                    raise ConversionError(f"storage {key}: {len(raw)} bytes for {numel} bf16")
                u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
                arr = u.view(np.float32)
            else:
                arr = np.frombuffer(raw, dtype=np.dtype(dt).newbyteorder("<"))
                if arr.size != numel:
                    raise ConversionError(
                        f"storage {key}: {arr.size} elements in the file, pickle says {numel}")
            cache[key] = (arr, arr.itemsize)
        return cache[key]

    try:
        return _RestrictedUnpickler(io.BytesIO(zf.read(pkl[0])), storage).load()
    except (EOFError, IndexError, KeyError, TypeError, AttributeError, ValueError,
            struct.error) as e:
        if isinstance(e, ConversionError):
            raise
        raise ConversionError(f"malformed pickle in {pkl[0]}: {type(e).__name__}: {e}") from e


def _f32_str(x: float) -> str:
    """Shortest decimal that round-trips the float32 value (as C++ std::to_chars writes it)."""
    s = np.format_float_positional(np.float32(x), unique=True, trim="-")
    return s


def write_safetensors(tensors: Dict[str, np.ndarray], metadata: Dict[str, str]) -> bytes:
    """Deterministic safetensors bytes, laid out like the C++ SafetensorsWriter."""
    header: Dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    off = 0
    blobs = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype="<f4")
        blob = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(blob)]}
        off += len(blob)
        blobs.append(blob)
    js = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    js += b" " * ((8 - len(js) % 8) % 8)
    return struct.pack("<Q", len(js)) + js + b"".join(blobs)


def _kind_entry(layer: Dict[str, Any], kind: str) -> Optional[Dict[str, Any]]:
    for k in ((kind, "key") if kind == "k" else (kind, "value")):
        if k in layer:
            return layer[k]
    return None


# OSCAR composition names (factors in matrix-product order) -> kvpool metadata notation.
_COMPOSITIONS = {
    "r_h_pbr": "U*H*P_br", "plain": "U", "pbr": "P_br", "br": "U*P_br", "br_h128": "U*P_br*H",
    "r_h": "U*H", "h_pbr": "H*P_br", "h_r_pbr": "H*U*P_br", "h_pbr_r": "H*P_br*U",
}
_TARGETS = ("qqt", "sst", "ktk", "vtv")
# Which kind each target was fitted for: qqt (query-weighted) and ktk fit KEY rotations, sst
# (attention-weighted) and vtv VALUE rotations; the others (oscar, hadamard, ...) fit either.
_KEY_TARGETS = {"qqt": "query-weighted key target", "ktk": "key target K^T K"}
_VALUE_TARGETS = {"sst": "attention-weighted value target", "vtv": "value target V^T V"}
ORTHOGONALITY_LIMIT = 1e-4  # as the C++ reader (kernels/src/rotation_file.cc)


def _objective_and_composition(k_obj: str, v_obj: str) -> Tuple[str, str]:
    """kvpool (objective, composition) metadata from the two files' OSCAR objective strings."""
    def split(o: str) -> Tuple[str, str]:
        if o in ("oscar", "hadamard", "identity", "uresidual"):
            return o, {"oscar": "U*H*P_br", "hadamard": "H", "identity": "I",
                       "uresidual": "U_e*Pi*U^T"}[o]
        target, _, comp = o.partition("_")
        if target in _TARGETS and comp:
            return target, _COMPOSITIONS.get(comp, comp)
        return o, o

    (kt, kc), (vt, vc) = split(k_obj), split(v_obj)
    if kc != vc:
        raise ConversionError(f"keys and values use different compositions ({k_obj!r} vs "
                              f"{v_obj!r})")
    if (kt, vt) == ("qqt", "sst"):
        return "oscar", kc  # the paper's targets: query-weighted keys, attention-weighted values
    if kt == vt:
        return kt, kc
    return f"k:{k_obj},v:{v_obj}", kc


def _check_kinds(k_obj: str, v_obj: str) -> None:
    """ConversionError when the key file's objective names a value target or the value file's a
    key target: the files were given swapped (the keys would be rotated with the value
    rotations, and the other way round, without any other sign)."""
    k_target, v_target = k_obj.partition("_")[0], v_obj.partition("_")[0]
    wrong = []
    if k_target in _VALUE_TARGETS:
        wrong.append(f"the --keys file's objective {k_obj!r} is a value rotation "
                     f"('{k_target}' = {_VALUE_TARGETS[k_target]})")
    if v_target in _KEY_TARGETS:
        wrong.append(f"the --values file's objective {v_obj!r} is a key rotation "
                     f"('{v_target}' = {_KEY_TARGETS[v_target]})")
    if wrong:
        raise ConversionError(
            "; ".join(wrong) + ": were --keys and --values swapped? Give the key file "
            "(objective qqt_* or ktk_*, e.g. k_rotation_qqt_r_h_pbr.pt) as --keys and the value "
            "file (sst_* or vtv_*, e.g. v_rotation_sst_r_h_pbr.pt) as --values")


def _tensor(value: Any, what: str, dtype) -> np.ndarray:
    """A numeric tensor (numpy array as load_pt returns them) as `dtype`; ConversionError for
    anything else (a string, a nested list of strings, None)."""
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "biuf":
        raise ConversionError(f"{what} is a {type(value).__name__}"
                              f"{' of ' + str(value.dtype) if isinstance(value, np.ndarray) else ''}"
                              ", not a numeric tensor")
    return value.astype(dtype)


def _layer_map(obj: Dict[str, Any], name: str) -> Dict[int, Any]:
    out: Dict[int, Any] = {}
    for key, entry in obj["layers"].items():
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)  # a string key "3" as some writers store it
        lid = _int_field(key, f"{name} file: layer key")
        if lid in out:
            raise ConversionError(f"{name} file: layer {lid} appears twice")
        if not isinstance(entry, dict):
            raise ConversionError(f"{name} file: layer {lid} is not a dict")
        if "layer_id" in entry and _int_field(entry["layer_id"],
                                              f"{name} file: layer {lid} layer_id") != lid:
            raise ConversionError(f"{name} file: layer key {lid} holds layer_id "
                                  f"{entry['layer_id']}")
        out[lid] = entry
    return out


def convert(keys_obj: Dict[str, Any], values_obj: Optional[Dict[str, Any]], *, model_name: str,
            num_kv_heads: Optional[int], clip_k: float = 0.96, clip_v: float = 0.92,
            source_hash: str = "", renumber_layers: bool = False) -> bytes:
    """Builds the kvpool rotation file bytes from loaded RotationZoo objects.

    keys_obj / values_obj: the loaded ``.pt`` dicts (values_obj None when keys_obj holds both
    kinds per layer). Per-layer vs per-head comes from the rotation tensors' rank. Raises
    ConversionError naming the layer, kind and problem for any malformed input.
    """
    for name, obj in (("keys", keys_obj), ("values", values_obj)):
        if obj is None:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("layers"), dict):
            raise ConversionError(f"{name} file: expected a dict with a 'layers' dict")
        fv = _int_field(obj.get("format_version", 1), f"{name} file: format_version")
        if fv not in (1, 2):
            raise ConversionError(f"{name} file: format_version {fv} is not 1 or 2")
    if values_obj is not None:  # one file per kind: its objective says which kind it holds
        _check_kinds(str(keys_obj.get("objective", "oscar")),
                     str(values_obj.get("objective", keys_obj.get("objective", "oscar"))))
    layers_k = _layer_map(keys_obj, "keys")
    layers_v = _layer_map(values_obj, "values") if values_obj is not None else None
    src_ids = sorted(layers_k)
    if not src_ids:
        raise ConversionError("keys file: no layers")
    if layers_v is not None and sorted(layers_v) != src_ids:
        raise ConversionError(f"keys file has layers {src_ids}, values file "
                              f"{sorted(layers_v)}")
    if src_ids != list(range(len(src_ids))) and not renumber_layers:
        raise ConversionError(
            f"layer ids {src_ids} are not 0..{len(src_ids) - 1} (global ids of a hybrid "
            "model's attention layers?): pass --renumber-layers to store them as 0..L-1 in "
            "ascending order")
    tensors: Dict[str, np.ndarray] = {}
    d = None
    heads = None
    ndim = None
    for i, lid in enumerate(src_ids):
        lk = layers_k[lid]
        for kind in ("k", "v"):
            entry = _kind_entry(lk, kind)
            if entry is None:
                if layers_v is None:
                    raise ConversionError(
                        f"layer {lid} has no '{kind}' entry: give --values for the value rotations")
                entry = lk if kind == "k" else layers_v[lid]
            if not isinstance(entry, dict) or "rotation" not in entry:
                raise ConversionError(f"layer {lid} {kind}: no 'rotation' tensor")
            r = _tensor(entry["rotation"], f"layer {lid} {kind} rotation", np.float64)
            e = entry.get("eigenvalues")
            if r.ndim not in (2, 3) or r.shape[-1] != r.shape[-2]:
                raise ConversionError(f"layer {lid} {kind} rotation has shape {r.shape}, expected "
                                      "[d, d] or [H_kv, d, d]")
            if ndim is None:
                ndim = r.ndim
            if r.ndim != ndim:
                raise ConversionError(f"layer {lid} {kind}: per-layer and per-head rotations mixed "
                                      f"(rank {r.ndim} after rank {ndim})")
            if d is None:
                d = r.shape[-1]
            if r.shape[-1] != d:
                raise ConversionError(f"layer {lid} {kind}: head_dim {r.shape[-1]} != {d}")
            if d < 8 or d & (d - 1):
                raise ConversionError(f"head_dim {d} is not a power of two >= 8")
            if r.ndim == 3:
                if heads is None:
                    heads = r.shape[0]
                if r.shape[0] != heads:
                    raise ConversionError(f"layer {lid} {kind}: {r.shape[0]} heads != {heads}")
            if not np.all(np.isfinite(r)):
                raise ConversionError(f"layer {lid} {kind} rotation has non-finite values")
            r32 = r.astype(np.float32)
            err = float(np.max(np.abs(np.matmul(r32.astype(np.float64),
                                                np.swapaxes(r32, -1, -2).astype(np.float64))
                                      - np.eye(d))))
            if err > ORTHOGONALITY_LIMIT:
                raise ConversionError(f"layer {lid} {kind} rotation is not orthogonal: "
                                      f"max|R*R^T - I| = {err:.3g} > {ORTHOGONALITY_LIMIT}")
            tensors[f"layers.{i}.{kind}.rotation"] = r32
            if e is not None:
                e = _tensor(e, f"layer {lid} {kind} eigenvalues", np.float32)
                if e.shape != r.shape[:-1]:
                    raise ConversionError(f"layer {lid} {kind} eigenvalues shape {e.shape} != "
                                          f"{r.shape[:-1]}")
                tensors[f"layers.{i}.{kind}.eigenvalues"] = e
    has_eig = [n for n in tensors if n.endswith("eigenvalues")]
    if has_eig and len(has_eig) != 2 * len(src_ids):
        raise ConversionError("eigenvalues must be present for every layer and kind, or none")
    version = 2 if ndim == 3 else 1
    for name, obj in (("keys", keys_obj), ("values", values_obj)):
        if obj is not None and _int_field(obj.get("format_version", version),
                                          f"{name} file: format_version") == 2 and version == 1:
            raise ConversionError(f"{name} file says format_version 2 (per head) but its "
                                  "rotations are [d, d]")
    if version == 2:
        if num_kv_heads is not None and num_kv_heads != heads:
            raise ConversionError(f"--num-kv-heads {num_kv_heads} != the file's {heads} heads")
        num_kv_heads = heads
    if num_kv_heads is None:
        raise ConversionError("--num-kv-heads is required for per-layer (format_version 1) files")
    if num_kv_heads < 1:
        raise ConversionError(f"--num-kv-heads must be >= 1, got {num_kv_heads}")
    for flag, clip in (("--clip-k", clip_k), ("--clip-v", clip_v)):
        if not (math.isfinite(clip) and 0.0 <= clip <= 1.0):
            raise ConversionError(f"{flag} must be 0 (disabled) or in (0, 1], got {clip}")
        if clip > 0.0 and np.float32(clip) == 0.0:  # as `kvpool calibrate` (newcomer report 13b)
            raise ConversionError(f"{flag} {clip} is positive but rounds to 0 in the file's "
                                  "float32 (clipping disabled); give 0, or at least 1e-38")
    clip_k, clip_v = clip_k + 0.0, clip_v + 0.0  # -0 is 0, as in _clip_ratio
    k_obj = str(keys_obj.get("objective", "oscar"))
    v_obj = str(values_obj.get("objective", k_obj)) if values_obj is not None else k_obj
    objective, composition = _objective_and_composition(k_obj, v_obj)
    meta = {
        "format": FORMAT_NAME,
        "format_version": str(version),
        "objective": objective,
        "composition": composition,
        "model_name": model_name,
        "head_dim": str(d),
        "num_layers": str(len(src_ids)),
        "num_kv_heads": str(num_kv_heads),
        "clip_ratio_k": _f32_str(clip_k),
        "clip_ratio_v": _f32_str(clip_v),
        "source_hash": source_hash,
    }
    if src_ids != list(range(len(src_ids))):
        meta["source_layer_ids"] = ",".join(str(i) for i in src_ids)
    return write_safetensors(tensors, meta)


def _positive_int(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{v}' is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _clip_ratio(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{v}' is not a number") from None
    if not (math.isfinite(x) and 0.0 <= x <= 1.0):  # as `kvpool calibrate --clip-k`
        raise argparse.ArgumentTypeError(f"must be 0 (disabled) or in (0, 1], got '{v}'")
    return x + 0.0  # -0 is 0: one rotation id and namespace for "clipping disabled"


def _read_input(path: str, flag: str) -> bytes:
    """The bytes of a regular file of at most MAX_INPUT_BYTES (a FIFO or /dev/zero would block
    or never end); OSError / ConversionError naming the flag otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConversionError(f"{flag}: '{path}' is not a regular file")
        if st.st_size > MAX_INPUT_BYTES:
            raise ConversionError(f"{flag}: '{path}' is {st.st_size} bytes, above the limit of "
                                  f"{MAX_INPUT_BYTES}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_INPUT_BYTES + 1)
        if len(data) > MAX_INPUT_BYTES:
            raise ConversionError(f"{flag}: '{path}' grew above {MAX_INPUT_BYTES} bytes")
        return data
    finally:
        os.close(fd)


def _check_output(path: str) -> Optional[str]:
    """Why `path` cannot take the output, found before any work (None when it can): a
    directory, a missing directory, or one where no file can be created."""
    target = os.path.realpath(path)
    if os.path.isdir(target):
        return f"--out: '{path}' is a directory; name a file"
    if os.path.exists(target) and not os.path.isfile(target):
        return f"--out: '{path}' is not a regular file"
    d = os.path.dirname(target) or "."
    if not os.path.isdir(d):
        return f"--out: directory '{d}' of '{path}' does not exist"
    try:
        fd, probe = tempfile.mkstemp(dir=d, prefix=".rotation_zoo-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"--out: cannot create a file in directory '{d}' of '{path}': {e.strerror}"
    return None


def _write_atomically(path: str, data: bytes) -> None:
    """Temporary file beside the target (through a symlink), fsync, os.replace: a reader never
    sees half a file and a failed write leaves the old one."""
    target = os.path.realpath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target) or ".",
                               prefix=os.path.basename(target) + ".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="rotation_zoo", description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", required=True,
                   help="RotationZoo .pt of the key rotations (objective qqt_* / ktk_*, e.g. "
                        "k_rotation_qqt_r_h_pbr.pt), or one holding both kinds")
    p.add_argument("--values",
                   help="RotationZoo .pt of the value rotations (objective sst_* / vtv_*, e.g. "
                        "v_rotation_sst_r_h_pbr.pt); files given swapped are refused")
    p.add_argument("--out", required=True, help="output .safetensors (written atomically)")
    p.add_argument("--model-name", required=True)
    p.add_argument("--num-kv-heads", type=_positive_int,
                   help="required for format_version 1 files (>= 1)")
    p.add_argument("--clip-k", type=_clip_ratio, default=0.96, help="0 or in (0, 1]")
    p.add_argument("--clip-v", type=_clip_ratio, default=0.92, help="0 or in (0, 1]")
    p.add_argument("--renumber-layers", action="store_true",
                   help="store sparse global layer ids (hybrid models) as 0..L-1, ascending")
    a = p.parse_args(argv)
    problem = _check_output(a.out)
    if problem:
        print(f"rotation_zoo: {problem}", file=sys.stderr)
        return 2
    try:
        kb = _read_input(a.keys, "--keys")
        vb = _read_input(a.values, "--values") if a.values else None
        src = hashlib.sha256(kb + (vb or b"")).hexdigest()
        out = convert(load_pt(kb), load_pt(vb) if vb else None, model_name=a.model_name,
                      num_kv_heads=a.num_kv_heads, clip_k=a.clip_k, clip_v=a.clip_v,
                      source_hash="sha256:" + src, renumber_layers=a.renumber_layers)
        _write_atomically(a.out, out)
    except (OSError, ConversionError, pickle.UnpicklingError, MemoryError) as e:
        print(f"rotation_zoo: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}: rotation id {hashlib.sha256(out).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
