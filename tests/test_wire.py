"""The wire format: round trips for every dtype, and every kind of damage is a
CorruptObject (never an exception of another type, never wrong bytes)."""

from __future__ import annotations

import importlib.util
import struct

import cbor2
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.tiers import fill, in_a_newer_format, key, make_pool, same_bytes

from kvtier.config import load_config
from kvtier.storage import wire
from kvtier.storage.serde import CorruptObject, NaiveSerde, NewerFormat, make_serde, tensor_bytes
from kvtier.storage.wire import checksum_of
from kvtier_kernels import registry

_HAVE_TRITON = importlib.util.find_spec("triton") is not None

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8]


@pytest.fixture
def pool():
    pool = make_pool(16)
    yield pool
    pool.close()


def blob_of(parts) -> bytes:
    return b"".join(bytes(p) for p in parts)


def _header_of(blob: bytes, name: str) -> wire.Header:
    header_len, header_checksum = wire.read_prefix(blob[: wire.PREFIX_SIZE])
    return wire.parse_header(
        blob[wire.PREFIX_SIZE : wire.PREFIX_SIZE + header_len], name, header_checksum
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 16, 64), (1, 2, 7, 576), (2, 1, 1, 80)])
def test_round_trip_is_bit_exact(pool, dtype, shape):
    obj = fill(pool, seed=3, shape=shape, dtype=dtype)
    name = key(1).to_string()
    parts = wire.encode(name, obj.tensor, NaiveSerde())
    back = wire.decode(blob_of(parts), name, pool.allocate)
    assert back is not None and same_bytes(back, obj)
    assert back.checksum == obj.checksum  # the engine's checksum survives the trip
    _, header_checksum = wire.read_prefix(parts[0][: wire.PREFIX_SIZE])
    header = wire.parse_header(bytes(parts[0][wire.PREFIX_SIZE :]), name, header_checksum)
    assert header.shape == shape and header.dtype == dtype and header.codec == "naive"
    assert header.payload_len == obj.data_nbytes


def test_payload_is_not_copied_on_encode(pool):
    obj = fill(pool, seed=1)
    parts = wire.encode("k", obj.tensor, NaiveSerde())
    tensor_bytes(obj.tensor)[0] ^= 0xFF  # the payload part is a view of the buffer
    assert bytes(parts[1][:1]) == bytes(tensor_bytes(obj.tensor)[:1])


def test_a_known_checksum_is_not_recomputed_and_still_guards_the_payload(pool, monkeypatch):
    obj = fill(pool, seed=5)
    name = key(5).to_string()
    plain = wire.encode(name, obj.tensor, NaiveSerde())
    hashed = []
    monkeypatch.setattr(wire, "checksum_of", lambda *b: hashed.append(b) or checksum_of(*b))
    known = wire.encode(name, obj.tensor, NaiveSerde(), checksum=obj.checksum)
    assert len(hashed) == 1  # the header only: the payload's checksum was given
    assert _header_of(blob_of(known), name).checksum == _header_of(blob_of(plain), name).checksum
    back = wire.decode(blob_of(known), name, pool.allocate)
    assert back is not None and same_bytes(back, obj)
    # bytes changed after the checksum was taken: the object is refused when read
    stale = wire.encode(name, obj.tensor, NaiveSerde(), checksum=obj.checksum ^ 1)
    with pytest.raises(CorruptObject, match="payload checksum"):
        wire.decode(blob_of(stale), name, pool.allocate)


def test_a_known_checksum_is_ignored_by_a_transforming_codec(pool):
    obj = _kv_like(pool, 6)
    name = key(6).to_string()
    parts = wire.encode(name, obj.tensor, make_serde("cachegen"), checksum=12345)
    assert wire.decode(blob_of(parts), name, pool.allocate) is not None  # payload hashed


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(name=st.text(max_size=300), tokens=st.integers(1, 40))
def test_the_payload_starts_at_an_aligned_offset(pool, name, tokens):
    obj = pool.allocate((2, 1, tokens, 8), torch.float16)
    obj.tensor.fill_(1.0)
    parts = wire.encode(name, obj.tensor, NaiveSerde())
    assert len(parts[0]) % wire.PAYLOAD_ALIGN == 0
    back = wire.decode(blob_of(parts), name, pool.allocate)
    assert back is not None and same_bytes(back, obj)
    back.ref_down()
    obj.ref_down()


def test_an_object_without_padding_still_reads(pool):
    """Objects written before the header carried ``pad`` decode as before."""
    obj = fill(pool, seed=8)
    name = key(8).to_string()
    blob = blob_of(wire.encode(name, obj.tensor, NaiveSerde()))
    header = _header_of(blob, name)
    header_len = struct.unpack_from("<I", blob, 6)[0]
    fields = cbor2.loads(blob[wire.PREFIX_SIZE : wire.PREFIX_SIZE + header_len])
    del fields["pad"]
    bare = cbor2.dumps(fields)
    old = wire.PREFIX.pack(wire.MAGIC, wire.VERSION, len(bare), checksum_of(bare)) + bare
    back = wire.decode(old + blob[wire.PREFIX_SIZE + header_len :], name, pool.allocate)
    assert back is not None and same_bytes(back, obj) and back.checksum == header.checksum


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8], ids=str)
def test_a_token_major_object_decodes_into_the_chunk_layout(pool, dtype):
    """``encode_buffers``: the header, then the caller's buffers themselves (no copy),
    checksummed over those bytes; a token-major payload decodes transposed."""
    chunk = fill(pool, seed=4, dtype=dtype)  # [planes, layers, tokens, width]
    token_major = chunk.tensor.transpose(1, 2).contiguous()  # [planes, tokens, layers, width]
    runs = tuple(tensor_bytes(token_major[p]) for p in range(2))
    buffers = wire.ChunkBuffers(chunk.shape, dtype, wire.TOKEN_MAJOR_LAYOUT, runs)
    name = key(4).to_string()
    parts = wire.encode_buffers(name, buffers)
    assert parts[1:] == list(runs) and len(parts[0]) % wire.PAYLOAD_ALIGN == 0
    header = _header_of(blob_of(parts), name)
    assert header.layout == wire.TOKEN_MAJOR_LAYOUT and header.shape == chunk.shape
    assert header.checksum == checksum_of(tensor_bytes(token_major))
    back = wire.decode(blob_of(parts), name, pool.allocate)
    assert back is not None and same_bytes(back, chunk) and back.checksum == chunk.checksum
    back.ref_down()
    chunk.ref_down()


def _damaged(pool, how: str) -> tuple[bytes, str]:
    obj = fill(pool, seed=7)
    name = key(2).to_string()
    blob = bytearray(blob_of(wire.encode(name, obj.tensor, NaiveSerde())))
    obj.ref_down()
    header_len = struct.unpack_from("<I", blob, 6)[0]
    header_end = wire.PREFIX_SIZE + header_len
    fields = cbor2.loads(bytes(blob[wire.PREFIX_SIZE : header_end]))

    def consistent(header: bytes, payload: bytes = bytes(blob[header_end:])) -> bytes:
        """An object whose prefix matches its header: only the field checks can refuse it."""
        return (
            bytes(blob[:6])
            + struct.pack("<IQ", len(header), checksum_of(header))
            + header
            + payload
        )

    def with_header(**changes):
        return consistent(cbor2.dumps({**fields, **changes}))

    if how == "magic":
        blob[0:4] = b"PKL\x80"
    elif how == "version":
        blob[4:6] = struct.pack("<H", 99)
    elif how == "header_len":
        blob[6:10] = struct.pack("<I", len(blob) * 4)
    elif how == "header_garbage":
        return consistent(b"\xff" * header_len), name
    elif how == "header_bit":
        blob[header_end - 3] ^= 0x10  # inside the informational "created" time, too
    elif how == "header_checksum":
        blob[12] ^= 0x01
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
    elif how == "empty_shape":  # consistent but for a dimension of 0 (no chunk has one)
        empty = {"shape": [2, 0, 16, 64], "payload_len": 0, "checksum": checksum_of(b"")}
        return consistent(cbor2.dumps({**fields, **empty}), b""), name
    elif how == "dtype":
        return with_header(dtype="complex64"), name
    elif how == "codec":
        return with_header(codec="pickle"), name
    elif how == "codec_params":
        return with_header(codec_params={"bins": [1]}), name
    elif how == "layout":
        return with_header(layout="KV_L2TD"), name
    elif how == "token_major_coded":  # token-major objects are written verbatim only
        return with_header(layout=wire.TOKEN_MAJOR_LAYOUT, codec="cachegen"), name
    elif how == "token_major_3d":
        return with_header(layout=wire.TOKEN_MAJOR_LAYOUT, shape=[2, 3, 1024]), name
    elif how == "missing_field":
        fields.pop("checksum")
        return with_header(), name
    elif how == "not_a_map":
        return consistent(cbor2.dumps([1, 2, 3]), b""), name
    return bytes(blob), name


DAMAGE = [
    "magic",
    "version",
    "header_len",
    "header_garbage",
    "header_bit",
    "header_checksum",
    "payload_bit",
    "truncated",
    "trailing",
    "prefix_only",
    "other_key",
    "shape",
    "empty_shape",
    "dtype",
    "codec",
    "codec_params",
    "layout",
    "token_major_coded",
    "token_major_3d",
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


@pytest.mark.parametrize("how", ["shape", "empty_shape"])
def test_a_shape_its_payload_cannot_fill_is_refused_before_a_buffer_is_allocated(pool, how):
    blob, name = _damaged(pool, how)
    asked: list[tuple] = []
    with pytest.raises(CorruptObject):
        wire.decode(blob, name, lambda shape, dtype: asked.append(shape))
    assert asked == [], "a buffer was asked for an object that is not a chunk"


def test_no_buffer_is_a_plain_none(pool):
    obj = fill(pool, seed=1)
    blob = blob_of(wire.encode("k", obj.tensor, NaiveSerde()))
    assert wire.decode(blob, "k", lambda shape, dtype: None) is None


def test_unknown_serde_is_named():
    with pytest.raises(ValueError, match="remote_serde"):
        make_serde("zstd")


# -- properties: whatever the bytes, a clean miss -----------------------------------------

_POOL = make_pool(4)
_OBJ = fill(_POOL, seed=11, shape=(2, 2, 4, 16))
_NAME = key(5).to_string()
_BLOB = blob_of(wire.encode(_NAME, _OBJ.tensor, NaiveSerde()))
_PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _must_miss(data: bytes) -> None:
    used = _POOL.used_bytes()
    with pytest.raises(CorruptObject):
        wire.decode(data, _NAME, _POOL.allocate)
    assert _POOL.used_bytes() == used


def test_the_property_blob_is_valid():
    back = wire.decode(_BLOB, _NAME, _POOL.allocate)
    assert back is not None and same_bytes(back, _OBJ)
    back.ref_down()


@_PROPERTY
@given(st.data())
def test_any_single_bit_flip_is_a_miss(data):
    position = data.draw(st.integers(0, len(_BLOB) * 8 - 1))
    damaged = bytearray(_BLOB)
    damaged[position // 8] ^= 1 << (position % 8)
    _must_miss(bytes(damaged))


@_PROPERTY
@given(st.integers(0, len(_BLOB) - 1))
def test_any_truncation_is_a_miss(length):
    _must_miss(_BLOB[:length])


@_PROPERTY
@given(st.binary(min_size=1, max_size=64))
def test_any_trailing_bytes_are_a_miss(extra):
    _must_miss(_BLOB + extra)


@_PROPERTY
@given(st.binary(max_size=4096))
def test_random_bytes_are_a_miss(data):
    _must_miss(data)


@_PROPERTY
@given(st.binary(max_size=512))
def test_random_bytes_after_a_valid_prefix_are_a_miss(data):
    _must_miss(_BLOB[: wire.PREFIX_SIZE] + data)


# -- the cachegen serde inside the wire format ----------------------------------------


def _kv_like(pool, seed: int, shape=(2, 3, 32, 64)):
    """Smooth per-token magnitudes with a few outlier channels, like real KV."""
    obj = pool.allocate(shape, torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(shape, generator=gen) * torch.rand((*shape[:3], 1), generator=gen)
    data[..., :2] *= 12.0
    obj.tensor.copy_(data)
    return obj


def test_cachegen_round_trip_is_within_its_bound_and_smaller(pool):
    obj = _kv_like(pool, 1)
    name = key(9).to_string()
    parts = wire.encode(name, obj.tensor, make_serde("cachegen"))
    blob = blob_of(parts)
    assert _header_of(blob, name).codec == "cachegen"
    assert len(blob) < obj.data_nbytes / 2  # compressed, headers and tables included
    back = wire.decode(blob, name, pool.allocate)
    original, decoded = obj.tensor.float(), back.tensor.float()
    scale = original.abs().amax(dim=-1, keepdim=True)
    # the codec's bound with its default schedule (at least 8 levels per side) + bf16
    assert bool(((original - decoded).abs() <= scale / 16 + scale * 2**-8).all())
    assert back.checksum == checksum_of(tensor_bytes(back.tensor))  # the engine re-checks


def test_a_chunk_cachegen_cannot_take_is_stored_raw(pool):
    obj = fill(pool, seed=4)  # random bit patterns: NaNs and infinities
    name = key(3).to_string()
    blob = blob_of(wire.encode(name, obj.tensor, make_serde("cachegen")))
    back = wire.decode(blob, name, pool.allocate)
    assert same_bytes(back, obj)


@pytest.mark.parametrize(
    ("shape", "dtype", "why"),
    [
        ((1, 2, 16, 32), torch.bfloat16, "plane"),  # MLA: one plane
        ((2, 2, 16, 32), torch.float8_e4m3fn, "dtype"),
        ((2, 2, 16, 32), torch.uint8, "dtype"),
    ],
)
def test_chunks_cachegen_cannot_code_are_stored_as_they_are_and_said_once(pool, shape, dtype, why):
    """An MLA chunk or an fp8/int cache goes naive, bit for bit; the reason is the same
    words for every chunk of the cache, whatever its token count (save_unfull_chunk), so
    it is logged once."""
    serde = make_serde("cachegen")
    reasons = set()
    for tokens, seed in ((16, 11), (5, 12), (9, 13)):
        obj = fill(pool, seed, shape=(*shape[:2], tokens, shape[3]), dtype=dtype)
        with pytest.raises(ValueError) as refused:
            serde.encode(obj.tensor)
        reasons.add(str(refused.value))
        name = key(seed).to_string()
        blob = blob_of(wire.encode(name, obj.tensor, serde))
        assert _header_of(blob, name).codec == "naive"
        assert same_bytes(wire.decode(blob, name, pool.allocate), obj)
    assert len(reasons) == 1 and why in reasons.pop()


def test_a_tensor_that_is_no_kv_chunk_goes_naive_unsaid(pool, caplog):
    """CacheBlend's segment positions (``[n]`` int64) under cachegen: stored as they are,
    with no warning (they are no KV chunk, let alone an MLA one)."""
    serde = make_serde("cachegen")
    for n in (5, 9):
        obj = pool.allocate((n,), torch.int64)
        obj.tensor.copy_(torch.arange(100, 100 + n))
        name = key(20 + n).to_string()
        with caplog.at_level("WARNING"):
            blob = blob_of(wire.encode(name, obj.tensor, serde))
        assert _header_of(blob, name).codec == "naive"
        assert torch.equal(wire.decode(blob, name, pool.allocate).tensor, obj.tensor)
    assert "cannot take" not in caplog.text and "MLA" not in caplog.text


def test_damaged_cachegen_payload_is_a_corrupt_object(pool):
    obj = _kv_like(pool, 2)
    name = key(4).to_string()
    parts = wire.encode(name, obj.tensor, make_serde("cachegen"))
    header = bytes(parts[0])
    payload = bytearray(b"".join(bytes(p) for p in parts[1:]))
    payload[len(payload) // 2] ^= 0x5A
    fields = cbor2.loads(header[wire.PREFIX_SIZE :])
    fields["checksum"] = checksum_of(bytes(payload))  # get past the wire checksum
    new = cbor2.dumps(fields)
    forged = header[:6] + struct.pack("<IQ", len(new), checksum_of(new)) + new + bytes(payload)
    with pytest.raises(CorruptObject):
        wire.decode(forged, name, pool.allocate)


def _forged(name: str, blob: bytes, **fields) -> bytes:
    """``blob`` with its header's ``fields`` replaced (and its checksums made to hold)."""
    header_len, _ = wire.read_prefix(blob[: wire.PREFIX_SIZE])
    end = wire.PREFIX_SIZE + header_len
    header = cbor2.loads(blob[wire.PREFIX_SIZE : end])
    header.update(fields)
    payload = blob[end:]
    codec_params = header["codec_params"]
    return wire.encode_header(
        name, header["layout"], torch.bfloat16, tuple(header["shape"]), header["codec"],
        codec_params, payload_len=len(payload), checksum=checksum_of(payload), aligned=False,
    ) + payload  # fmt: skip


@pytest.mark.parametrize("what", ["version", "layout", "codec", "cachegen_version"])
def test_an_object_of_a_newer_kvtier_is_a_newer_format_saying_what(pool, what):
    """What a newer kvtier may write is a miss that says what this one does not know,
    raised as ``NewerFormat`` (a ``CorruptObject``, so every reader's miss path holds),
    which the tiers count and log apart from damage."""
    obj = _kv_like(pool, 6)
    name = key(6).to_string()
    serde = make_serde("cachegen" if what == "cachegen_version" else "naive")
    blob = blob_of(wire.encode(name, obj.tensor, serde))
    if what == "version":
        blob = in_a_newer_format(blob)
    elif what == "layout":
        blob = _forged(name, blob, layout="KV_2TLD_PAGED")
    elif what == "codec":
        blob = _forged(name, blob, codec="zstd_kv")
    else:
        params = cbor2.loads(blob[wire.PREFIX_SIZE :])["codec_params"]
        blob = _forged(name, blob, codec_params={**params, "version": 6})
    said = {
        "version": "format version 2; this kvtier reads up to 1",
        "layout": "chunk layout 'KV_2TLD_PAGED'",
        "codec": "codec 'zstd_kv'",
        "cachegen_version": "cachegen bitstream version 6; this kvtier reads up to 5",
    }[what]
    used = pool.used_bytes()
    with pytest.raises(NewerFormat, match=said):
        wire.decode(blob, name, pool.allocate)
    assert pool.used_bytes() == used


def test_cachegen_levels_come_from_the_config(pool):
    obj = _kv_like(pool, 5)  # 3 layers
    name = key(5).to_string()
    config = load_config({"cachegen_k_levels": "32,16,4", "cachegen_v_levels": 2}, env={})
    blob = blob_of(wire.encode(name, obj.tensor, make_serde("cachegen", config)))
    params = _header_of(blob, name).codec_params
    assert params["k_levels"] == [32, 16, 4] and params["v_levels"] == [2, 2, 2]
    back = wire.decode(blob, name, pool.allocate)  # a reader with other settings
    original, decoded = obj.tensor.float(), back.tensor.float()
    scale = original.abs().amax(dim=-1, keepdim=True)
    levels = torch.tensor([[32, 16, 4], [2, 2, 2]], dtype=torch.float32)[:, :, None, None]
    assert bool(((original - decoded).abs() <= scale / (2 * levels) + scale * 2**-8).all())


def test_a_schedule_for_another_layer_count_stores_raw_and_says_why(pool, caplog):
    obj = _kv_like(pool, 6)  # 3 layers, the schedule lists 2
    name = key(6).to_string()
    config = load_config({"cachegen_k_levels": "16,8"}, env={})
    with caplog.at_level("WARNING"):
        blob = blob_of(wire.encode(name, obj.tensor, make_serde("cachegen", config)))
    assert _header_of(blob, name).codec == "naive"
    assert "cachegen_k_levels lists 2 layers, the model has 3" in caplog.text
    assert same_bytes(wire.decode(blob, name, pool.allocate), obj)


def test_cachegen_device_must_exist():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    config = load_config({"remote_serde": "cachegen", "cachegen_device": "cuda"}, env={})
    with pytest.raises(ValueError, match="cachegen_device is cuda, but torch sees no GPU"):
        make_serde("cachegen", config)
    assert make_serde("cachegen", load_config({}, env={})).device == torch.device("cpu")


@pytest.mark.skipif(not _HAVE_TRITON, reason="needs triton (its interpreter runs here)")
def test_cachegen_triton_coder_writes_the_reference_bytes(pool):
    """kernel_backend interpret: the serde's rANS runs as the Triton kernel (interpreted);
    its payload is byte-identical to the reference's, and each reads the other's."""
    obj = _kv_like(pool, 7, shape=(2, 1, 8, 4))
    name = key(7).to_string()
    interpret = make_serde("cachegen", load_config({"kernel_backend": "interpret"}, env={}))
    reference = make_serde("cachegen", load_config({"kernel_backend": "torch"}, env={}))
    assert (interpret.backend, reference.backend) == ("interpret", "torch")
    parts = wire.encode(name, obj.tensor, interpret)
    other = wire.encode(name, obj.tensor, reference)
    blob = blob_of(parts)
    assert blob_of(parts[1:]) == blob_of(other[1:])  # the payloads (headers carry a time)
    assert _header_of(blob, name).codec_params == _header_of(blob_of(other), name).codec_params
    by_kernel = wire.decode(blob, name, pool.allocate, interpret)
    by_reference = wire.decode(blob, name, pool.allocate, reference)
    assert same_bytes(by_kernel, by_reference)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_cachegen_on_the_gpu_writes_the_reference_bytes(pool):
    obj = _kv_like(pool, 8, shape=(2, 4, 256, 512))
    name = key(8).to_string()
    gpu = make_serde("cachegen", load_config({"cachegen_device": "auto"}, env={}))
    cpu = make_serde("cachegen", load_config({"cachegen_device": "cpu"}, env={}))
    assert gpu.device.type == "cuda"
    assert registry.pick("rans_encode", gpu.backend, gpu.device) == "triton"
    assert registry.pick("rans_encode", cpu.backend, cpu.device) in ("numba", "torch")
    parts, other = wire.encode(name, obj.tensor, gpu), wire.encode(name, obj.tensor, cpu)
    assert blob_of(parts[1:]) == blob_of(other[1:])
    blob = blob_of(parts)
    assert same_bytes(
        wire.decode(blob, name, pool.allocate, gpu), wire.decode(blob, name, pool.allocate, cpu)
    )
