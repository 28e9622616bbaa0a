# ReFlow quick start. Each target creates/reuses .venv and installs what is missing.
#   make train   - train the tiny embedded default on CPU (2 ranks, no download)
#   make test    - run the test suite
#   make bench   - a benchmark that writes JSON (BENCH=modes|placement|resize|generation|trainer|sandbox|agents, default modes)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
CONFIG ?= train_configs/tiny.toml
STAMP  := $(VENV)/.reflow-installed

.PHONY: install sandbox-tools train test bench test-torch-gpu-version clean-venv

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[cpu,test]'
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports next to the CPU torch.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, torchtitan, vllm, tomli, tensorboard, pytest; print('reflow stack ok: torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

install: $(STAMP)

# bubblewrap, the code sandbox's boundary (never fails: tasks that need it refuse to start without it)
sandbox-tools:
	@bash torchrun_scripts/install_sandbox.sh

train: $(STAMP) sandbox-tools
	@# the demo starts afresh each time (a run refuses a folder that holds another run: reflow/run_record.py)
	@if [ "$(CONFIG)" = "train_configs/tiny.toml" ] && [ -z "$(ARGS)" ]; then rm -rf outputs/tiny; fi
	NPROC=$(NPROC) CONFIG=$(CONFIG) PYTHON=$(PY) bash torchrun_scripts/run_train.sh $(ARGS)

test: $(STAMP) sandbox-tools
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m reflow.bench $(or $(BENCH),modes) $(ARGS)

# The trainer-side tests against the torch of the GPU extra (2.14, PyPI's CUDA build: it runs on a CPU), in a venv of
# their own without vLLM (the GPU build of vLLM does not run here): tests that need neither vLLM nor a GPU.
TORCH_GPU_VERSION ?= 2.14.0
VENV_GPU_TORCH ?= .venv-torch$(subst .,,$(TORCH_GPU_VERSION))
TRAINER_TESTS ?= tests/trainer tests/model tests/algorithms tests/test_memory_plan.py tests/distributed/test_placement.py
test-torch-gpu-version:
	test -x $(VENV_GPU_TORCH)/bin/python || $(PYTHON) -m venv $(VENV_GPU_TORCH)
	$(VENV_GPU_TORCH)/bin/python -m pip install -q "torch==$(TORCH_GPU_VERSION)" torchtitan==0.3.0 tomli tensorboard safetensors \
	  tokenizers transformers numpy pillow pyarrow pytest hypothesis
	$(VENV_GPU_TORCH)/bin/python -m pip install -q --no-deps -e .
	$(VENV_GPU_TORCH)/bin/python -m pytest -q $(TRAINER_TESTS) $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
