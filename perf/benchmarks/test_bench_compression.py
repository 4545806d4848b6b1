"""CacheGen codec benchmarks: compression ratio vs error, and encode / decode GB/s.

The codec is ``kvtier_kernels/cachegen/codec.py`` at its default per-layer level schedule
(``default_levels``) on the CPU, with each of its CPU coders: ``numba`` (what ``auto``
runs where numba is installed: the numba kernels of ``kvtier_kernels/cachegen/numba_kernels.py``
and ``kvtier_kernels/cachegen/rans/``, on numba's threads) and the reference (backend
``torch``: torch quantization, the numpy rANS coder). Both write the same bytes. Three
chunks in ``KV_2LTD`` (``[2, num_layers, num_tokens, hidden]``, bf16), from
``tests/support/samples.py``:

- ``llama_kv``: K (post-RoPE) and V of a real forward pass of a random-weight
  ``transformers`` Llama: 8 layers, 8 KV heads x head size 128, 256 tokens (8 MiB);
- ``synthetic_kv``: log-normal channel magnitudes with 4 outlier K channels and per-token
  magnitudes: 32 layers x hidden 1024 x 256 tokens (32 MiB, the tier benchmarks' chunk);
- ``small_kv``: the same kind of data for a small model's short chunk: 4 layers x 2 KV
  heads x head size 64, 64 tokens (128 KiB), where fixed costs per call show;
- ``small_llama_kv_64`` / ``small_llama_kv_256``: a real forward pass of a small random-weight
  Llama (4 layers, 2 KV heads x head size 64), chunks of 64 and 256 tokens (128 / 512 KiB),
  where the statistics stored per lane weigh most.

Rows (``perf/report/`` puts ``compression …`` rows in its ratio-vs-error section and
GB/s rows in its throughput section):

- ``compression cachegen (<data>)``: value = raw bf16 bytes ÷ compressed bytes (payload +
  the params as compact JSON, which stand in for their CBOR header field), unit ``x``;
  baseline = the int8 row's ratio, so ``ratio`` is how much smaller cachegen is than
  int8.
- ``compression cachegen stored object (64 tokens, <heads>x<head size>)`` and ``(…,
  model_a)``: the naive object's bytes ÷ the cachegen object's, both as the disk / fs tier
  writes them (header with the key included), for the second 64-token chunk of a small
  random-weight Llama (4 layers; ``model_a``: the engine tests' 2-layer model), with the
  header and sections' bytes, bits per symbol and the error;
- ``compression int8 (<data>)``: the plain 8-bit baseline of the same data, per-token
  absmax int8 codes + one fp32 scale per (K/V, layer, token); baseline uncompressed bf16.
- ``error`` (both): ``max |x - x̂| ÷ token absmax``, the largest error of any element
  relative to the absmax of its (K/V, layer, token) row — the quantity the codec bounds
  by ``1 / (2 n) + 2**-8`` (``n`` levels_half; ``2**-8``: rounding to bf16). The rows also
  carry ``rel_frobenius_error`` (``‖x - x̂‖ ÷ ‖x‖``) and the bound.
- ``cachegen encode`` / ``decode (CPU numba, <data>)`` and ``(CPU reference, <data>)``:
  GB/s of raw (bf16) KV, against the int8 quantize / dequantize of the same chunk (torch)
  measured in the same run; the rows also carry a raw ``torch`` copy of the same bytes
  (``raw_copy_gbps``) and the threads the coder ran on.
- ``cachegen fetch + CPU numba decode at 10 Gb/s (derived, <data>)`` and ``cachegen fetch
  + CPU decode at 10 Gb/s (derived, <data>)`` (the reference): NOT measured on a network.
  From the measured decode GB/s and ratio: ``time_raw = bytes / 1.25e9``, ``time_compressed
  = bytes / ratio / 1.25e9 + bytes / decode``; value = bytes ÷ time_compressed (GB/s of
  raw KV delivered), baseline = raw fetch (1.25 GB/s), so ratio > 1 means compressing
  wins. ``break_even_link_gbit_s`` is the link speed below which it wins.

GPU rows (marked ``gpu``, skipped without one; ``make gpu-bench`` runs them): the Triton
coder (``backend="triton"``) on ``synthetic_kv``, ``llama_kv`` and ``small_kv``, each first
checked to write the CPU reference's bytes and decode to its round trip:

- ``cachegen encode`` / ``decode (GPU triton, <data>)``: encode = a chunk on the GPU to
  payload bytes on the host, decode = payload bytes into a chunk on the GPU; GB/s of raw
  KV against the int8 quantize / dequantize of the same chunk in torch on the GPU, timed
  in alternation (each call synchronized); ``raw_copy_gbps`` is a device copy of the chunk;
- ``cachegen fetch + GPU triton decode at 10 Gb/s (derived, <data>)``: the derived verdict
  above, with the GPU decode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from conftest import interleaved_medians, median_seconds

from kvtier_kernels import registry
from kvtier_kernels.cachegen import decode_chunk, default_levels, encode_chunk

TOKENS = 256
LLAMA_SHAPE = {"num_layers": 8, "num_heads": 8, "num_kv_heads": 8, "head_size": 128}
SYNTHETIC_SHAPE = {"layers": 32, "hidden": 1024}
SMALL_SHAPE = {"layers": 4, "hidden": 2 * 64, "tokens": 64}
SMALL_LLAMA_SHAPE = {"num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_size": 64}
SMALL_LLAMA_TOKENS = {"small_llama_kv_64": 64, "small_llama_kv_256": 256}
DATASETS = ("llama_kv", "synthetic_kv", "small_kv", *SMALL_LLAMA_TOKENS)
# the reference takes ~0.3 s (llama_kv) to ~2 s (synthetic_kv) per call, numba ~1/30 of it
ROUNDS = {
    ("llama_kv", "torch"): 5,
    ("synthetic_kv", "torch"): 3,
    ("small_kv", "numba"): 200,
    ("small_llama_kv_64", "numba"): 200,
    ("small_llama_kv_256", "numba"): 100,
}
OTHER_ROUNDS = 20
CODERS = {"numba": "CPU numba", "torch": "CPU reference"}  # backend -> row label
LINK_BYTES_PER_S = 10e9 / 8  # 10 Gb/s
BF16_ROUNDING = 2.0**-8  # relative rounding of x_hat to bf16, the chunk's dtype
FP32_SLACK = 2.0**-20  # the codec's own arithmetic (see cachegen/codec.py's error bound)
ERROR_METRIC = "max |x - x̂| ÷ token absmax"


def _kv_samples():
    """``tests/support/samples.py``, the codec's sample KV shared with the tests."""
    from support import samples as kv_samples

    return kv_samples


def int8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token absmax int8: ``x`` ``[2, L, T, D]`` → (codes int8 ``[2, L, T, D]``, scales
    fp32 ``[2, L, T, 1]``); ``x ≈ codes * scales``."""
    xf = x.float()
    scales = xf.abs().amax(dim=-1, keepdim=True) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(xf / safe).to(torch.int8), scales


def int8_dequantize(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(codes.float() * scales)


def int8_nbytes(codes: torch.Tensor, scales: torch.Tensor) -> int:
    return codes.numel() * codes.element_size() + scales.numel() * scales.element_size()


def relative_error(x: torch.Tensor, x_hat: torch.Tensor) -> tuple[float, float]:
    """(max |x - x̂| ÷ token absmax, ‖x - x̂‖ ÷ ‖x‖) of ``[2, L, T, D]`` chunks."""
    xf, diff = x.float(), (x.float() - x_hat.float()).abs()
    absmax = xf.abs().amax(dim=-1, keepdim=True)
    per_token = torch.where(absmax > 0, diff / absmax, diff)
    return per_token.max().item(), (diff.norm() / xf.norm()).item()


@dataclass(slots=True)
class Sample:
    name: str
    kv: torch.Tensor  # [2, L, T, D] bf16
    payload: bytes
    params: dict
    decoded: torch.Tensor  # cachegen round trip, bf16

    @property
    def raw_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def compressed_bytes(self) -> int:
        return len(self.payload) + len(json.dumps(self.params, separators=(",", ":")))

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.compressed_bytes


def _dataset(name: str) -> torch.Tensor:
    """The chunk of dataset ``name`` (``[2, L, T, D]`` bf16, on the CPU)."""
    kv_samples = _kv_samples()
    if name == "llama_kv":
        pytest.importorskip("transformers")
        return kv_samples.llama_kv(**LLAMA_SHAPE, tokens=TOKENS)
    if name in SMALL_LLAMA_TOKENS:
        pytest.importorskip("transformers")
        return kv_samples.llama_kv(**SMALL_LLAMA_SHAPE, tokens=SMALL_LLAMA_TOKENS[name])
    if name == "synthetic_kv":
        return kv_samples.synthetic_kv(**SYNTHETIC_SHAPE, tokens=TOKENS)
    return kv_samples.synthetic_kv(**SMALL_SHAPE)


def _coded(name: str, backend: str = "auto") -> Sample:
    """Dataset ``name`` with its payload and round trip through ``backend``'s coder."""
    kv = _dataset(name)
    payload, params = encode_chunk(kv, backend=backend)
    decoded = torch.empty_like(kv)
    decode_chunk(payload, params, decoded, backend=backend)
    return Sample(name, kv, payload, params, decoded)


@pytest.fixture(scope="module", params=DATASETS)
def sample(request) -> Sample:
    return _coded(request.param)


def _raw_copy_gbps(sample: Sample) -> float:
    dst = torch.empty_like(sample.kv)
    return sample.raw_bytes / median_seconds(lambda: dst.copy_(sample.kv)) / 1e9


def test_compression_ratio_and_error(record, sample):
    k_levels, v_levels = default_levels(sample.kv.shape[1])
    cachegen_bound = 1 / (2 * min(k_levels + v_levels)) + FP32_SLACK + BF16_ROUNDING
    cachegen_error, cachegen_fro = relative_error(sample.kv, sample.decoded)
    assert cachegen_error <= cachegen_bound, f"{sample.name}: cachegen error above its bound"

    codes, scales = int8_quantize(sample.kv)
    int8_decoded = torch.empty_like(sample.kv)
    int8_dequantize(codes, scales, int8_decoded)
    int8_bound = 1 / (2 * 127) + FP32_SLACK + BF16_ROUNDING
    int8_error, int8_fro = relative_error(sample.kv, int8_decoded)
    assert int8_error <= int8_bound, f"{sample.name}: int8 error above its bound"
    int8_ratio = sample.raw_bytes / int8_nbytes(codes, scales)

    shape = list(sample.kv.shape)
    record(
        metric=f"compression int8 ({sample.name})",
        value=int8_ratio,
        unit="x",
        baseline="uncompressed bf16",
        baseline_value=1.0,
        codec=f"int8 ({sample.name})",
        dataset=sample.name,
        shape=shape,
        error=int8_error,
        error_metric=ERROR_METRIC,
        error_bound=int8_bound,
        rel_frobenius_error=int8_fro,
    )
    record(
        metric=f"compression cachegen ({sample.name})",
        value=sample.ratio,
        unit="x",
        baseline=f"int8 absmax + fp32 scales ({sample.name})",
        baseline_value=int8_ratio,
        codec=f"cachegen ({sample.name})",
        dataset=sample.name,
        shape=shape,
        k_levels=k_levels,
        v_levels=v_levels,
        statistics_model=sample.params["model"],
        compressed_bytes=sample.compressed_bytes,
        raw_bytes=sample.raw_bytes,
        error=cachegen_error,
        error_metric=ERROR_METRIC,
        error_bound=cachegen_bound,
        rel_frobenius_error=cachegen_fro,
    )


# ---------------------------------------------------------------------------------------
# stored objects of 64-token chunks: what the disk / fs tier writes, against naive
# ---------------------------------------------------------------------------------------

STORED_TOKENS = 64
STORED_KEY = "kvtier1@meta-llama%2FLlama-3.1-8B-Instruct@1@0@bfloat16@" + "ab" * 32
STORED_SHAPES = {  # name -> llama_kv arguments (random-weight Llama, default init)
    **{
        f"{heads}x{head}": {"num_layers": 4, "num_kv_heads": heads, "head_size": head}
        for heads in (1, 2, 4, 8)
        for head in (64, 128)
    },
    # the engine tests' model A (tests/conftest.py): 2 layers, 8 query heads, 2 KV heads x 32
    "model_a": {"num_layers": 2, "num_kv_heads": 2, "head_size": 32, "weight_std": 0.08},
}


def _stored_kv(name: str) -> torch.Tensor:
    """The second 64-token chunk of a 128-token forward pass, bf16 ``[2, L, 64, D]``."""
    pytest.importorskip("transformers")
    shape = dict(STORED_SHAPES[name])
    heads = shape["num_kv_heads"]
    kv = _kv_samples().llama_kv(
        **shape, num_heads=8 if name == "model_a" else max(4, 2 * heads), tokens=2 * STORED_TOKENS
    )
    return kv[:, :, STORED_TOKENS:].contiguous()


@pytest.mark.parametrize("name", list(STORED_SHAPES))
def test_stored_object_ratio_64_tokens(record, name):
    """``compression cachegen stored object (64 tokens, <shape>)``: the bytes of the object
    the fs / disk tier writes for a naive chunk ÷ those of its cachegen object (header
    included: the prefix, the CBOR header with its key and the codec's params), with where
    the cachegen object's bytes go."""
    from kvtier.storage import wire
    from kvtier.storage.serde import CachegenSerde, NaiveSerde
    from kvtier_kernels.cachegen import MODELS

    kv = _stored_kv(name)
    naive = sum(len(part) for part in wire.encode(STORED_KEY, kv, NaiveSerde()))
    header, payload = wire.encode(STORED_KEY, kv, CachegenSerde(device="cpu"))
    params = wire.parse_header(
        header[wire.PREFIX_SIZE :], STORED_KEY, wire.checksum_of(header[wire.PREFIX_SIZE :])
    ).codec_params
    decoded = torch.empty_like(kv)
    CachegenSerde(device="cpu").decode(memoryview(payload), params, decoded)
    error, fro = relative_error(kv, decoded)
    k_levels, v_levels = default_levels(kv.shape[1])
    bound = 1 / (2 * min(k_levels + v_levels)) + FP32_SLACK + BF16_ROUNDING
    assert error <= bound
    stored = len(header) + len(payload)
    record(
        metric=f"compression cachegen stored object ({STORED_TOKENS} tokens, {name})",
        value=naive / stored,
        unit="x",
        baseline="naive object (same chunk, same key)",
        baseline_value=1.0,
        codec=f"cachegen stored object ({name})",
        dataset=f"llama_kv {name}",
        shape=list(kv.shape),
        naive_object_bytes=naive,
        stored_bytes=stored,
        header_bytes=len(header),
        section_bytes=dict(zip(MODELS[params["model"]], params["sections"], strict=True)),
        bits_per_symbol=8 * stored / kv.numel(),
        statistics_model=params["model"],
        version=params["version"],
        error=error,
        error_metric=ERROR_METRIC,
        error_bound=bound,
        rel_frobenius_error=fro,
    )


@pytest.fixture(params=list(CODERS))
def coder(request) -> str:
    """The CPU coder's backend: ``numba`` (skipped where it does not run) or ``torch``."""
    if request.param == "numba" and registry.pick("rans_encode", "auto", "cpu") != "numba":
        pytest.skip(f"numba does not run here: {registry.available_backends()['numba']}")
    return request.param


def _threads(coder: str) -> int:
    if coder != "numba":
        return torch.get_num_threads()  # the reference's torch steps; its rANS is numpy
    import numba

    return numba.get_num_threads()


def test_encode_throughput(benchmark, record, sample, coder):
    baseline_seconds = median_seconds(lambda: int8_quantize(sample.kv))
    payload, _ = benchmark.pedantic(
        encode_chunk,
        args=(sample.kv,),
        kwargs={"backend": coder},
        rounds=ROUNDS.get((sample.name, coder), OTHER_ROUNDS),
        warmup_rounds=1,
    )
    assert payload == sample.payload  # deterministic, and the same bytes with either coder
    _record_gbps(
        record, sample, "encode", coder, benchmark, "int8 absmax quantize", baseline_seconds
    )


def _record_gbps(
    record, sample, op: str, coder: str, benchmark, baseline: str, baseline_seconds: float
):
    """One ``cachegen <op>`` row: GB/s of raw KV against ``baseline`` (same chunk, same
    run); returns the codec's median seconds."""
    seconds = benchmark.stats.stats.median
    record(
        metric=f"cachegen {op} ({CODERS[coder]}, {sample.name})",
        value=sample.raw_bytes / seconds / 1e9,
        unit="GB/s",
        baseline=f"{baseline} (torch, same chunk)",
        baseline_value=sample.raw_bytes / baseline_seconds / 1e9,
        raw_copy_gbps=_raw_copy_gbps(sample),
        dataset=sample.name,
        coder=coder,
        threads=_threads(coder),
    )
    return seconds


def test_decode_throughput(benchmark, record, sample, coder):
    codes, scales = int8_quantize(sample.kv)
    out = torch.empty_like(sample.kv)
    baseline_seconds = median_seconds(lambda: int8_dequantize(codes, scales, out))
    benchmark.pedantic(
        decode_chunk,
        args=(sample.payload, sample.params, out),
        kwargs={"backend": coder},
        rounds=ROUNDS.get((sample.name, coder), OTHER_ROUNDS),
        warmup_rounds=1,
    )
    assert torch.equal(out, sample.decoded)
    decode_seconds = _record_gbps(
        record, sample, "decode", coder, benchmark, "int8 dequantize", baseline_seconds
    )
    decoder = "CPU numba decode" if coder == "numba" else "CPU decode"
    _record_fetch_verdict(record, sample, decode_seconds, decoder, coder)


def _record_fetch_verdict(record, sample: Sample, decode_seconds: float, decoder: str, coder):
    """The derived row: fetching ``sample`` compressed at 10 Gb/s, then decoding it in
    ``decode_seconds``, against fetching it raw. Not measured on a network."""
    decode_gbps = sample.raw_bytes / decode_seconds / 1e9
    time_raw = sample.raw_bytes / LINK_BYTES_PER_S
    time_compressed = sample.raw_bytes / sample.ratio / LINK_BYTES_PER_S + decode_seconds
    # compressed wins iff bytes / link * (1 - 1 / ratio) > decode time
    break_even = decode_gbps * 1e9 * (1 - 1 / sample.ratio) * 8 / 1e9
    record(
        metric=f"cachegen fetch + {decoder} at 10 Gb/s (derived, {sample.name})",
        value=sample.raw_bytes / time_compressed / 1e9,
        unit="GB/s",
        baseline="raw fetch at 10 Gb/s (derived)",
        baseline_value=sample.raw_bytes / time_raw / 1e9,
        derived=True,
        time_raw_s=time_raw,
        time_compressed_s=time_compressed,
        compressed_beats_raw=time_compressed < time_raw,
        break_even_link_gbit_s=break_even,
        dataset=sample.name,
        coder=coder,
    )


# ---------------------------------------------------------------------------------------
# GPU: the Triton coder (marked ``gpu``, skipped without one)
# ---------------------------------------------------------------------------------------

HAS_GPU = torch.cuda.is_available()
GPU_DATASETS = ("synthetic_kv", "llama_kv", "small_kv")
GPU_ROUNDS = {"small_kv": 50}
GPU_OTHER_ROUNDS = 15


@pytest.fixture(scope="module", params=GPU_DATASETS)
def reference_sample(request) -> Sample:
    """A dataset coded by the CPU reference (``torch``): the bytes and the round trip the
    Triton coder must reproduce (numba, whichever version is installed, plays no part)."""
    return _coded(request.param, backend="torch")


def _synced(fn):
    def run() -> object:
        result = fn()
        torch.cuda.synchronize()
        return result

    return run


def _record_gpu_gbps(record, sample: Sample, op: str, seconds: float, baseline: str, baseline_s):
    kv = sample.kv.cuda()
    dst = torch.empty_like(kv)
    copy_seconds = median_seconds(_synced(lambda: dst.copy_(kv)))
    record(
        metric=f"cachegen {op} (GPU triton, {sample.name})",
        value=sample.raw_bytes / seconds / 1e9,
        unit="GB/s",
        baseline=f"{baseline} (torch on the GPU, same chunk)",
        baseline_value=sample.raw_bytes / baseline_s / 1e9,
        raw_copy_gbps=sample.raw_bytes / copy_seconds / 1e9,
        dataset=sample.name,
        coder="triton",
        device=torch.cuda.get_device_name(0),
    )


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA/ROCm GPU (the Triton coder)")
@pytest.mark.parametrize("op", ["encode", "decode"])
def test_gpu_coder_throughput(record, reference_sample, op):
    """Encode a chunk on the GPU to payload bytes on the host, or decode payload bytes
    into a chunk on the GPU, with the Triton coder; checked against the reference's bytes
    and round trip first, timed in alternation with the int8 quantize / dequantize."""
    sample = reference_sample
    kv = sample.kv.cuda()
    rounds = GPU_ROUNDS.get(sample.name, GPU_OTHER_ROUNDS)
    if op == "encode":
        assert encode_chunk(kv, backend="triton") == (sample.payload, sample.params)
        run = _synced(lambda: encode_chunk(kv, backend="triton"))
        baseline, baseline_run = "int8 absmax quantize", _synced(lambda: int8_quantize(kv))
    else:
        out = torch.empty_like(kv)
        decode_chunk(sample.payload, sample.params, out, backend="triton")
        assert torch.equal(out.cpu(), sample.decoded), "the Triton decode is not the reference's"
        codes, scales = int8_quantize(kv)
        run = _synced(lambda: decode_chunk(sample.payload, sample.params, out, backend="triton"))
        baseline = "int8 dequantize"
        baseline_run = _synced(lambda: int8_dequantize(codes, scales, out))
    seconds, baseline_seconds = interleaved_medians(run, baseline_run, repeat=rounds)
    _record_gpu_gbps(record, sample, op, seconds, baseline, baseline_seconds)
    if op == "decode":
        _record_fetch_verdict(record, sample, seconds, "GPU triton decode", "triton")
