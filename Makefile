# ReFlow quick start. Each target creates/reuses .venv and installs what is missing.
#   make train   - train the tiny embedded default on CPU (2 ranks, no download)
#   make test    - run the test suite
#   make bench   - a benchmark that writes JSON (BENCH=modes|resize|generation|trainer|sandbox, default modes)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
CONFIG ?= train_configs/tiny.toml
STAMP  := $(VENV)/.reflow-installed

.PHONY: install sandbox-tools train test bench clean-venv

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

clean-venv:
	rm -rf $(VENV)
