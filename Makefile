# dpkit: `make finetune` and `make test` set themselves up on first use.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
NPROC ?= 2
STRATEGY ?= ddp
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dpkit-installed
# DeepSpeed's JIT-built CPU ops (cpu_adam, deepspeed_shm_comm) in a folder per venv: torch's
# default, ~/.cache/torch_extensions/py311_cpu, is shared by every venv, and a build against
# another venv's torch is rebuilt (75-570 s for cpu_adam on 2 cores), so venvs that take turns
# rebuild at every launch. The same key as tests/conftest.py's (sha256 of the venv's real path).
TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/torch_extensions/venv-$(shell printf %s "$(realpath $(VENV))" | sha256sum | cut -c1-12)
export TORCH_EXTENSIONS_DIR

.PHONY: setup finetune test test-fast mutate lint format bench-zero bench-trainer tune gpu-check clean

setup: $(STAMP)

# The venv sees system site-packages so that a GPU box's own CUDA torch is used
# as is, provided it is in the series dpkit was tested on (pyproject.toml); setup
# stops with one line otherwise rather than replace it. Without torch, a machine
# with no NVIDIA driver gets the CPU build: first from a local wheel folder (pip's
# find-links), else from PyTorch's CPU index; it never falls through to PyPI's
# multi-GB CUDA wheels. The rest comes from constraints.txt, the set the suite passed on.
TORCH_IN_RANGE := import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v != (2, 13))
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv --system-site-packages $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		if ! $(PY) -c '$(TORCH_IN_RANGE)'; then \
			echo "setup: error: installed torch $$($(PY) -c 'import torch; print(torch.__version__)') is outside the series dpkit is tested on (2.13.x, pyproject.toml); setup keeps an installed torch, so install torch 2.13 first"; \
			exit 2; \
		fi; \
		echo "setup: keeping installed torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install "torch==$(TORCH_VERSION)"; \
	else \
		if $(PY) -m pip download -q --no-index --no-deps "torch==$(TORCH_VERSION)" -d $(VENV)/torch-wheel 2>/dev/null; then \
			$(PY) -m pip install $(VENV)/torch-wheel/torch-*.whl; \
		else \
			$(PY) -m pip install "torch==$(TORCH_VERSION)" --extra-index-url https://download.pytorch.org/whl/cpu; \
		fi; \
	fi
	$(PY) -m pip install -c constraints.txt -e ".[test]"
	$(VENV)/bin/dpkit data fetch
	touch $(STAMP)

# The main job: fine-tune all-MiniLM-L6-v2 on Rotten Tomatoes, STRATEGY (ddp, zero1, zero2)
# on NPROC processes (CPU with gloo, or GPUs).
finetune: setup
	$(VENV)/bin/accelerate launch --config_file ds_configs/accelerate/$(STRATEGY).yaml --num_processes $(NPROC) \
		recipes/finetune.py --output-dir runs/finetune --overwrite-output-dir

# On CPU, 4 processes show what sharding saves (at 2, DeepSpeed's layout leaves little);
# 4 timed steps keep it near 4 minutes on 2 cores (docs/bench-cpu-4proc.md). GPUs: all of them.
BENCH_CPU_ARGS := --nproc 4 --steps 4 --warmup 1
# DDP vs ZeRO-1 vs ZeRO-2 side by side (plus bare torch/DeepSpeed baselines):
# memory per rank, throughput, loss equivalence -> bench_results/latest/{results.json,results.md,chart.png}
bench-zero: setup
	$(VENV)/bin/dpkit bench $$($(PY) -c "import torch; print('' if torch.cuda.is_available() else '$(BENCH_CPU_ARGS)')") --output-dir bench_results/latest

# dpkit's fine-tuning recipe against the plain Transformers Trainer, same job, DDP and
# ZeRO-2, 3 interleaved repeats (about 11 minutes on 2 CPU cores; docs/bench.md)
bench-trainer: setup
	$(VENV)/bin/dpkit bench --workload classification --output-dir bench_results/trainer

# The fastest strategy x micro-batch x ZeRO buckets at a fixed global batch, measured
# (train_lm.py; 21 trials, 6.3 minutes on 2 CPU cores) -> tune_results/latest (docs/tune.md)
tune: setup
	$(VENV)/bin/dpkit tune --output-dir tune_results/latest

# The in-process tests on one worker per core (pytest-xdist, at most 4), then the real
# launches one at a time: each of them already keeps every core busy.
FAST_TESTS := -m "not multiprocess" -n auto --maxprocesses 4

test: setup lint
	$(PY) -m pytest -ra $(FAST_TESTS) tests
	$(PY) -m pytest -ra --durations=40 -m multiprocess tests

test-fast: setup
	$(PY) -m pytest -ra $(FAST_TESTS) tests

# Mutation testing of the modules whose mistakes are silent ([tool.mutmut] in pyproject.toml)
# against the fast tests; prints the score per module, fails below 90% or on a survivor that
# is neither killed nor explained in tests/mutation_equivalents.txt (docs/testing.md).
# Incremental: mutants/ keeps results of unchanged functions; `rm -rf mutants` starts over.
mutate: setup
	$(PY) tests/mutation_report.py

lint: setup
	$(VENV)/bin/ruff check dpkit recipes tests
	$(VENV)/bin/ruff format --check dpkit recipes tests

format: setup
	$(VENV)/bin/ruff format dpkit recipes tests
	$(VENV)/bin/ruff check --fix dpkit recipes tests

clean:
	rm -rf $(VENV) runs .pytest_cache

# The GPU check (a machine with CUDA), plain pytest: the `gpu` tests (tests/test_gpu_runs.py:
# finetune.py as DDP and ZeRO-2 in bf16, memory report against the prediction and `dpkit plan
# --against`; train_lm.py's tokens/s and MFU; tests/test_memory.py's CUDA report), each launch
# once, every figure asserted (a failure names figure, value, bound). At most 150 s a test (a
# launch counts in the first test that needs it), none started after 390 s: under 9 minutes in
# all. Runs, logs and junit.xml (the figures) in runs/gpu-check. Without CUDA: one line and
# exit code 2 before pytest (dpkit/bench/gpu_check.py).
GPU_TEST_TIMEOUT_S := 150
GPU_SESSION_TIMEOUT_S := 390
gpu-check: setup
	$(PY) -m dpkit.bench.gpu_check
	$(PY) -m pytest -m gpu -ra --timeout $(GPU_TEST_TIMEOUT_S) --session-timeout $(GPU_SESSION_TIMEOUT_S) \
		--basetemp runs/gpu-check --junitxml runs/gpu-check/junit.xml tests
