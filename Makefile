# `make test` and `make serve` do all the set-up on a fresh machine.
# A virtual environment is created in .venv unless one is already active.
ifdef VIRTUAL_ENV
PY := $(VIRTUAL_ENV)/bin/python
else
PY := .venv/bin/python
endif

HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: install test serve bench clean

$(PY):
	python3 -m venv .venv

# Reuse an installed torch; otherwise take torch==2.13.0 (the CPU wheel on this
# machine) before the project, so the `torch>=` requirement is already met and
# pip never pulls the CUDA wheels.
install: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'

# The second and third runs repeat the CPU-path tests as an AVX2-only x86-64
# CPU would run them (no AMX, no AVX-512, no prepacked bf16 linears), then as
# the first x86-64 CPUs would (SSE2 only: the native kernels' portable loops),
# so that a green run on a CPU with every fast path also covers the fallbacks.
AVX2_CAP := STEPSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
BASELINE_CAP := STEPSERVE_CPU_ISA=baseline ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)
	$(AVX2_CAP) $(PY) -m pytest -q -m "cpu_paths and not slow" $(PYTEST_ARGS)
	$(BASELINE_CAP) $(PY) -m pytest -q -m "cpu_paths and not slow" $(PYTEST_ARGS)

serve: install
	$(PY) -m stepserve.cli serve --host $(HOST) --port $(PORT)

bench: install
	$(PY) -m stepserve.cli bench offline

clean:
	rm -rf .venv build *.egg-info .pytest_cache .hypothesis
