"""Checkpoint state objects (checkpoint/tensorfile.py): JSON structure + a safetensors blob.

A real buffer's state round-trips exactly, and every hostile blob is a CheckpointError naming the
problem, raised before safetensors is handed the bytes (safetensors would otherwise allocate what
a forged header claims, or fail with its own exception type)."""

import json
import math
import struct
import warnings
import zlib

import pytest
import safetensors.numpy
import safetensors.torch
import torch
from rollouts import make_batch

import torchreplay as tr
from torchreplay import snapshot
from torchreplay.checkpoint import tensorfile
from torchreplay.errors import CheckpointError

ALLOWED = list(tensorfile.DTYPE_CODES)


def assert_same(a, b, path="state"):
    """Exact equality, tensors by dtype, shape and value; tuples were stored as lists."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(), b.nan_to_num())), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert type(a) is type(b) and a == b, path


def busy_buffer():
    buf = tr.RolloutBuffer(32, sampler=tr.PrioritizedSampler(alpha=0.6, beta=0.4), max_staleness=4, max_reuse=3,
                           seed=3)
    gen = torch.Generator().manual_seed(0)
    for v in range(4):
        out = buf.compose(make_batch(10, version=v, seed=v, group_base=10 * v), replay_ratio=0.5, generator=gen)
        buf.update_priorities(out.handles, torch.randn(out.handles.slot.numel(), generator=gen))
        buf.advance(v + 1)
    return buf


def test_a_real_buffer_state_round_trips_exactly():
    buf = busy_buffer()
    state = snapshot.metadata_state(buf)
    assert sum(isinstance(v, torch.Tensor) for v in state["table"].values()) > 5  # the slot table is in it
    text, blob = tensorfile.pack(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's warning about tensors over read-only memory
        restored = tensorfile.unpack(text, blob)
        for t in restored["table"].values():  # a restored ledger writes its slot table in place
            t.copy_(t.clone())
    assert_same(state, restored)


def test_edge_tensors_and_values_round_trip():
    t = torch.arange(12)
    state = {
        "dtypes": [torch.arange(6).reshape(2, 3).to(d) for d in ALLOWED],
        "empty": [torch.empty(0, dtype=d) for d in ALLOWED] + [torch.empty(3, 0, 2)],
        "scalar": [torch.tensor(7), torch.tensor(2.5, dtype=torch.bfloat16), torch.tensor(True)],
        "views": {"whole": t, "again": t, "slice": t[3:7], "strided": t[::2]},  # shared memory is copied
        "floats": [float("inf"), float("-inf"), float("nan"), -0.0, 1e-300],
        "plain": {"n": None, "b": False, "i": -(2**62), "s": "ü", "nested": [[{"x": []}], {}], "tuple": (1, "a")},
        "nan tensor": torch.tensor([float("nan"), 1.0]),
    }
    assert_same(state, tensorfile.unpack(*tensorfile.pack(state)))


def test_the_blob_is_plain_safetensors():
    """Other tools read the blob without torchreplay: tensor i is named str(i)."""
    text, blob = tensorfile.pack({"a": torch.arange(4, dtype=torch.int32), "b": [torch.ones(2, 2)]})
    tree = json.loads(text)["tree"]
    arrays = safetensors.numpy.load(blob)
    assert arrays[str(tree["a"]["__tensor__"])].tolist() == [0, 1, 2, 3]
    assert arrays[str(tree["b"][0]["__tensor__"])].tolist() == [[1, 1], [1, 1]]


def test_pack_refuses_what_unpack_would_refuse():
    with pytest.raises(TypeError, match="dtype"):
        tensorfile.pack({"x": torch.zeros(2, dtype=torch.complex64)})
    deep = []
    for _ in range(tensorfile.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(ValueError, match="deeper"):
        tensorfile.pack(deep)


# Hostile inputs. `seal` records the blob's true CRC, as a forger would, so the check under test is
# the one that meets the input rather than the checksum.

def seal(tree, blob):
    return json.dumps({"format": "safetensors", "tree": tree, "blob_crc32": zlib.crc32(blob)}).encode()


def raw_blob(header, data=b""):
    header = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(header)) + header + data


def good():
    return tensorfile.pack({"x": torch.arange(5), "y": torch.ones(3)})


def retitled(header_len):
    _, blob = good()
    return struct.pack("<Q", header_len) + blob[8:]


def nested_tree(depth):
    tree = {"__tensor__": 0}
    for _ in range(depth):
        tree = [tree]
    return tree


ONE = {"0": {"dtype": "I64", "shape": [5], "data_offsets": [0, 40]}}
ONE_DATA = torch.arange(5).numpy().tobytes()


def case(tree, blob):
    return seal(tree, blob), blob


HOSTILE = {
    "header length past the blob": (lambda: case(json.loads(good()[0])["tree"], retitled(len(good()[1]))),
                                    "runs past the blob's end"),
    "header length 2**60": (lambda: case(json.loads(good()[0])["tree"], retitled(2**60)), "more than"),
    "blob shorter than a header length": (lambda: case({}, b"\x05\0\0"), "too short"),
    "truncated blob": (lambda: case(json.loads(good()[0])["tree"], good()[1][:-3]), "data bytes"),
    "non-JSON header": (lambda: case({"__tensor__": 0}, raw_blob(b"{not json at all", ONE_DATA)),
                        "not valid JSON"),
    "header not an object": (lambda: case([], raw_blob(b"[1, 2]")), "not a JSON object"),
    "nested header": (lambda: case([], raw_blob(b"[" * 100_000)), "nested too deeply"),
    "disallowed dtype": (lambda: case({"__tensor__": 0},
                                      safetensors.torch.save({"0": torch.zeros(2, dtype=torch.complex64)})),
                         "dtype 'C64' is not allowed"),
    "dtype not a string": (lambda: case({"__tensor__": 0}, raw_blob({"0": dict(ONE["0"], dtype=["I64"])}, ONE_DATA)),
                           "is not allowed"),
    "unsigned 64-bit dtype": (lambda: case({"__tensor__": 0}, raw_blob({"0": dict(ONE["0"], dtype="U64")}, ONE_DATA)),
                              "dtype 'U64' is not allowed"),
    "referenced tensor missing": (lambda: case([{"__tensor__": 0}, {"__tensor__": 7}], raw_blob(ONE, ONE_DATA)),
                                  r"lacks \['7'\]"),
    "unreferenced tensor": (lambda: case({"a": 1}, raw_blob(ONE, ONE_DATA)), r"nothing names \['0'\]"),
    "bool as a tensor index": (lambda: case({"__tensor__": True}, raw_blob(ONE, ONE_DATA)), "not a tensor index"),
    "shape larger than its bytes": (lambda: case({"__tensor__": 0},
                                                 raw_blob({"0": dict(ONE["0"], shape=[2**40])}, ONE_DATA)),
                                    "is not 40 bytes"),
    "negative dimension": (lambda: case({"__tensor__": 0}, raw_blob({"0": dict(ONE["0"], shape=[-5])}, ONE_DATA)),
                           "non-negative"),
    "offsets past the data": (lambda: case({"__tensor__": 0},
                                           raw_blob({"0": dict(ONE["0"], shape=[6], data_offsets=[0, 48])}, ONE_DATA)),
                              "outside the blob"),
    "trailing bytes after the tensors": (lambda: case({"__tensor__": 0}, raw_blob(ONE, ONE_DATA + bytes(8))),
                                         "cover 40 of its 48"),
    "overlapping tensors": (lambda: case([{"__tensor__": 0}, {"__tensor__": 1}],
                                         raw_blob({**ONE, "1": ONE["0"]}, ONE_DATA)), "overlap"),
    "malformed entry": (lambda: case({"__tensor__": 0}, raw_blob({"0": {"dtype": "I64"}}, ONE_DATA)), "malformed"),
    "deeply nested state JSON": (lambda: (b"[" * 100_000, good()[1]), "nested too deeply"),
    "state tree past the depth bound": (lambda: case(nested_tree(tensorfile.MAX_DEPTH + 5), raw_blob(ONE, ONE_DATA)),
                                        "nested too deeply"),
    "not JSON": (lambda: (b"\xff\xfe", good()[1]), "not valid JSON"),
    "no format": (lambda: (json.dumps({"tree": {}, "tensors": []}).encode(), b""), "not a safetensors state"),
    "no checksum": (lambda: (json.dumps({"format": "safetensors", "tree": {}}).encode(), b""), "blob_crc32"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_state_is_a_checkpoint_error_before_safetensors_reads_it(monkeypatch, name):
    make, match = HOSTILE[name]
    text, blob = make()

    def must_not_load(data):
        raise AssertionError("a hostile blob reached safetensors")

    monkeypatch.setattr(tensorfile, "st_load", must_not_load)
    with pytest.raises(CheckpointError, match=match):
        tensorfile.unpack(text, blob)


def test_corruption_is_a_checksum_mismatch():
    text, blob = good()
    for i in (3, 10, len(blob) - 1):  # header length, header JSON, tensor data
        bad = bytearray(blob)
        bad[i] ^= 0x01
        with pytest.raises(CheckpointError, match="checksum"):
            tensorfile.unpack(text, bytes(bad))
    with pytest.raises(CheckpointError, match="checksum"):
        tensorfile.unpack(text, blob[:-1])


def test_safetensors_errors_past_validation_are_checkpoint_errors():
    """A header our checks accept but safetensors rejects (malformed metadata) still surfaces as
    CheckpointError, never SafetensorError."""
    blob = raw_blob({"__metadata__": {"k": 1}, **ONE}, ONE_DATA)
    with pytest.raises(CheckpointError, match="not valid safetensors"):
        tensorfile.unpack(*case({"__tensor__": 0}, blob))
