"""The wire format: round trips for every dtype, and every kind of damage is a
CorruptObject (never an exception of another type, never wrong bytes)."""

from __future__ import annotations

import struct

import cbor2
import pytest
import torch
from tier_helpers import fill, key, make_pool, same_bytes

from kvtier.storage import wire
from kvtier.storage.serde import CorruptObject, NaiveSerde, make_serde, tensor_bytes

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8]


@pytest.fixture
def pool():
    pool = make_pool(16)
    yield pool
    pool.close()


def blob_of(parts) -> bytes:
    return b"".join(bytes(p) for p in parts)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 16, 64), (1, 2, 7, 576), (2, 1, 1, 80)])
def test_round_trip_is_bit_exact(pool, dtype, shape):
    obj = fill(pool, seed=3, shape=shape, dtype=dtype)
    name = key(1).to_string()
    parts = wire.encode(name, obj.tensor, NaiveSerde())
    back = wire.decode(blob_of(parts), name, pool.allocate)
    assert back is not None and same_bytes(back, obj)
    assert back.metadata == obj.metadata  # the engine's checksum survives the trip
    header = wire.parse_header(bytes(parts[0][wire.PREFIX_SIZE :]), name)
    assert header.shape == shape and header.dtype == dtype and header.codec == "naive"
    assert header.payload_len == obj.data_nbytes


def test_payload_is_not_copied_on_encode(pool):
    obj = fill(pool, seed=1)
    parts = wire.encode("k", obj.tensor, NaiveSerde())
    tensor_bytes(obj.tensor)[0] ^= 0xFF  # the payload part is a view of the buffer
    assert bytes(parts[1][:1]) == bytes(tensor_bytes(obj.tensor)[:1])


def _damaged(pool, how: str) -> tuple[bytes, str]:
    obj = fill(pool, seed=7)
    name = key(2).to_string()
    blob = bytearray(blob_of(wire.encode(name, obj.tensor, NaiveSerde())))
    obj.ref_down()
    header_len = struct.unpack_from("<I", blob, 6)[0]
    header_end = wire.PREFIX_SIZE + header_len
    fields = cbor2.loads(bytes(blob[wire.PREFIX_SIZE : header_end]))

    def with_header(**changes):
        new = cbor2.dumps({**fields, **changes})
        return bytes(blob[:6]) + struct.pack("<I", len(new)) + new + bytes(blob[header_end:])

    if how == "magic":
        blob[0:4] = b"PKL\x80"
    elif how == "version":
        blob[4:6] = struct.pack("<H", 99)
    elif how == "header_len":
        blob[6:10] = struct.pack("<I", len(blob) * 4)
    elif how == "header_garbage":
        blob[wire.PREFIX_SIZE : wire.PREFIX_SIZE + 8] = b"\xff" * 8
    elif how == "payload_bit":
        blob[-100] ^= 0x01
    elif how == "truncated":
        del blob[-1:]
    elif how == "trailing":
        blob += b"\x00"
    elif how == "prefix_only":
        del blob[8:]
    elif how == "other_key":
        return with_header(key=key(3).to_string()), name
    elif how == "shape":
        return with_header(shape=[2, 3, 16, 32]), name
    elif how == "dtype":
        return with_header(dtype="complex64"), name
    elif how == "codec":
        return with_header(codec="pickle"), name
    elif how == "codec_params":
        return with_header(codec_params={"bins": [1]}), name
    elif how == "missing_field":
        fields.pop("checksum")
        return with_header(), name
    elif how == "not_a_map":
        new = cbor2.dumps([1, 2, 3])
        return bytes(blob[:6]) + struct.pack("<I", len(new)) + new, name
    return bytes(blob), name


DAMAGE = [
    "magic",
    "version",
    "header_len",
    "header_garbage",
    "payload_bit",
    "truncated",
    "trailing",
    "prefix_only",
    "other_key",
    "shape",
    "dtype",
    "codec",
    "codec_params",
    "missing_field",
    "not_a_map",
]


@pytest.mark.parametrize("how", DAMAGE)
def test_damage_is_a_corrupt_object_and_frees_its_buffer(pool, how):
    blob, name = _damaged(pool, how)
    used = pool.used_bytes()
    with pytest.raises(CorruptObject):
        wire.decode(blob, name, pool.allocate)
    assert pool.used_bytes() == used, "a rejected object leaked its buffer"


def test_no_buffer_is_a_plain_none(pool):
    obj = fill(pool, seed=1)
    blob = blob_of(wire.encode("k", obj.tensor, NaiveSerde()))
    assert wire.decode(blob, "k", lambda shape, dtype: None) is None


def test_unknown_serde_is_named():
    with pytest.raises(ValueError, match="remote_serde"):
        make_serde("zstd")
