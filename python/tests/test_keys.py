"""Golden vectors for docs/KEYS.md, computed independently of the C++ code with hashlib.

The same hex strings are pinned in common/tests/keys_test.cc; both must agree.
"""
import hashlib
import struct


def _u32(v):
    return struct.pack("<I", v)


def _field(b):
    return _u32(len(b)) + b


def encode_namespace(tenant, model_id, revision, layers, kv_heads, head_dim, rotation_id,
                     page_size, sink, clip_k, clip_v, precision, tp=None):
    out = _field(_u32(1)) + _field(b"kvpool-block-v1")
    out += _field(tenant.encode()) + _field(model_id.encode()) + _field(revision.encode())
    out += _field(_u32(layers)) + _field(_u32(kv_heads)) + _field(_u32(head_dim))
    out += _field(rotation_id) + _field(_u32(page_size)) + _field(_u32(sink))
    out += _field(struct.pack("<f", clip_k)) + _field(struct.pack("<f", clip_v))
    out += _field(precision.encode())
    out += _field(b"canonical" if tp is None else _u32(tp[0]) + _u32(tp[1]))
    return out


def chain(root, tokens, page_size):
    keys, prev = [], root
    for i in range(len(tokens) // page_size):
        block = tokens[i * page_size:(i + 1) * page_size]
        prev = hashlib.sha256(prev + _u32(len(block)) + b"".join(_u32(t) for t in block)).digest()
        keys.append(prev)
    return keys


ROTATION_ID = hashlib.sha256(b"kvpool-test-rotation").digest()


def test_rotation_id():
    assert ROTATION_ID.hex() == "c1f9b8dae38143e7088e2e498feaaac14353cec61265fca29f2c0efef3792efa"


def test_golden_stories():
    ns = encode_namespace("default", "stories260K", "r1", 5, 4, 8, ROTATION_ID, 16, 64,
                          0.96, 0.92, "int2")
    assert len(ns) == 172
    root = hashlib.sha256(ns).digest()
    assert root.hex() == "b9dbaefc23947ab039efe1b4c8c74fe50d6adbf74ade1b3f401c00e9a2476677"
    keys = chain(root, list(range(40)), 16)
    assert [k.hex() for k in keys] == [
        "6a4c9c628b1cd244561f62a3b5d8f0a3b3c90ff4bf603094e9fdb5103b37e9ed",
        "bac191c4a348aa5e9f8a03e7cc0fd55bcd3d531414513040b306374d68bfe4cb",
    ]


def test_golden_tensor_parallel_bf16():
    ns = encode_namespace("acme", "m", "", 2, 1, 128, ROTATION_ID, 4, 0, 0.0, 0.5, "bf16",
                          tp=(1, 2))
    assert len(ns) == 156
    root = hashlib.sha256(ns).digest()
    assert root.hex() == "44fb11cbca654646639f4ad8f1fc0108f42dd81f0ee5efaa7e89cba61fb7a983"
    keys = chain(root, [1, 2, 3, 4, 4294967295, 0, 7, 65536], 4)
    assert [k.hex() for k in keys] == [
        "af1c94cc823beb91007d2bfcca65d3b96596bca2ba8fb17abb2eb69e19936cea",
        "48bf2ba1fe985fc1e6169e566e23a3541b4397b27464939c50c3b6aa88e725b0",
    ]
