"""Storage keys: canonical string form round-trips exactly."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.keys import CacheKey, KeyFormatError, geometry_tag
from kvtier.storage.remote import space_of


def test_string_form_is_stable_and_readable():
    key = CacheKey("meta-llama/Llama-3-8B", 2, 1, "bfloat16", bytes.fromhex("00ff10"))
    assert key.to_string() == "kvtier1@meta-llama%2FLlama-3-8B@2@1@bfloat16@00ff10"
    assert "/" not in key.to_string()
    assert CacheKey.from_string(key.to_string()) == key


def test_geometry_tag_is_readable_and_parses_back():
    """What the engines tag every chunk with: layers x KV heads x head size."""
    assert geometry_tag(32, 8, 128) == ("kv_geometry", "32x8x128")
    key = CacheKey("m", 1, 0, "bfloat16", b"\x01", tags=(geometry_tag(61, 1, 576),))
    assert key.to_string() == "kvtier1@m@1@0@bfloat16@01@kv_geometry=61x1x576"
    assert CacheKey.from_string(key.to_string()) == key


def test_a_model_path_that_is_not_utf8_names_chunks_of_its_own():
    """Python reads a path's bytes that are not UTF-8 (vLLM's --model from argv) as lone
    surrogates, which UTF-8 cannot encode: the path's own bytes name its chunks."""
    model = b"/models/caf\xe9".decode("utf-8", "surrogateescape")
    key = CacheKey(model, 1, 0, "bfloat16", b"\x01")
    assert key.to_string() == "kvtier1@%2Fmodels%2Fcaf%E9@1@0@bfloat16@01"
    assert CacheKey.from_string(key.to_string()) == key
    assert space_of(model) == "%2Fmodels%2Fcaf%E9"
    utf8 = CacheKey("/models/café", 1, 0, "bfloat16", b"\x01")
    assert utf8.to_string() == "kvtier1@%2Fmodels%2Fcaf%C3%A9@1@0@bfloat16@01"


names = st.text(min_size=1, max_size=40)


@given(
    model=names,
    world=st.integers(1, 64),
    data=st.data(),
    dtype=st.sampled_from(["bfloat16", "float16", "float8_e4m3fn", "weird@dtype/x"]),
    digest=st.binary(min_size=1, max_size=32),
    layer=st.none() | st.integers(0, 200),
    tags=st.lists(st.tuples(names, st.text(max_size=20)), max_size=3, unique_by=lambda t: t[0]),
)
def test_round_trip(model, world, data, dtype, digest, layer, tags):
    rank = data.draw(st.integers(0, world - 1))
    key = CacheKey(model, world, rank, dtype, digest, layer, tuple(tags))
    text = key.to_string()
    assert "/" not in text
    assert CacheKey.from_string(text) == key
    assert CacheKey.from_string(text).to_string() == text


def test_layerwise_variant():
    key = CacheKey("m", 1, 0, "float16", b"\x01\x02")
    layered = key.with_layer(7)
    assert layered.to_string().endswith("@L7")
    assert layered != key and layered.chunk_key() == key
    assert CacheKey.from_string(layered.to_string()).layer == 7


def test_tags_are_canonically_ordered():
    a = CacheKey("m", 1, 0, "float16", b"\x01", tags=(("b", "2"), ("a", "1")))
    b = CacheKey("m", 1, 0, "float16", b"\x01", tags=(("a", "1"), ("b", "2")))
    assert a == b and a.to_string() == b.to_string()


@pytest.mark.parametrize(
    "text",
    [
        "",
        "lmcache@m@1@0@h@bf16",
        "kvtier1@m@1@0@bfloat16",
        "kvtier1@m@x@0@bf16@00",
        "kvtier1@m@1@0@bf16@zz",
        "kvtier1@m@1@5@bf16@00",
        "kvtier1@m@1@0@bf16@00@junk",
    ],
)
def test_malformed_strings_raise(text):
    with pytest.raises(KeyFormatError):
        CacheKey.from_string(text)


def test_invalid_fields_raise():
    with pytest.raises(ValueError, match="rank=2"):
        CacheKey("m", 2, 2, "bf16", b"\x00")
    with pytest.raises(ValueError, match="model_name"):
        CacheKey("", 1, 0, "bf16", b"\x00")
