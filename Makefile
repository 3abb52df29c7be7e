# The README's two commands are `make demo` and `make test`; every other target serves them.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEPS   := $(VENV)/.deps-installed
EXT    := $(VENV)/.ext-built
SOURCES := $(shell find csrc -name '*.h' -o -name '*.cpp' -o -name '*.cu') setup.py
# A torch reinstalled into .venv means a rebuild: the extension is compiled against one torch.
TORCH_STAMP := $(wildcard $(VENV)/lib/python*/site-packages/torch/version.py)

.PHONY: demo test build pytest cuda-check ctest bench clean

demo: $(EXT)
	$(BIN)/torchreplay demo

test: cuda-check ctest pytest

$(DEPS): requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	@# torch first, pinned: on a machine without a GPU the pin resolves to the CPU wheel kept on local disk;
	@# an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install --disable-pip-version-check torch==2.13.0
	@if ! command -v nvidia-smi >/dev/null 2>&1 && $(BIN)/python -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then \
		echo "warning: a CUDA build of torch was installed on a machine without a GPU"; fi
	$(BIN)/pip install --disable-pip-version-check -r requirements-dev.txt
	$(BIN)/pip install --disable-pip-version-check --no-deps verl==0.9.1
	@# With a CUDA driver, the `gpu` extra (kvikio) too: its tests fail rather than skip without it.
	@if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install --disable-pip-version-check kvikio-cu13; fi
	@# Last: the stamp also tells the tests (tests/extras.py) that trl, verl and tensordict are installed.
	touch $@

$(EXT): $(DEPS) $(SOURCES) $(TORCH_STAMP)
	$(BIN)/pip install --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $@

build: $(EXT)

pytest: $(EXT)
	$(BIN)/python -m pytest -q tests

# Compile-only check of every CUDA source for sm_80 and sm_90 (no GPU needed); skipped without nvcc.
cuda-check:
	@bash tools/check_cuda_compile.sh

ctest:
	cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build build/cmake
	ctest --test-dir build/cmake --output-on-failure

bench: $(EXT)
	$(BIN)/python benchmarks/bench_tree.py

clean:
	rm -rf build torchreplay/_C*.so torchreplay.egg-info $(EXT)
