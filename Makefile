# The README's two commands: `make run` (main job) and `make test` (the test suite).
# Both create .venv on first use. --system-site-packages keeps a torch/triton that the machine
# already has (a GPU image); otherwise torch==2.13.0 and triton 3.6 (for its CPU interpreter) come
# from pip's index: from PyPI on Linux that torch is the CUDA build (several GB; runs on CPU too).
# The CPU-only build comes only from https://download.pytorch.org/whl/cpu (--index-url) or a
# local wheel store: install it into .venv first; the `import torch` check below keeps it.
PY := .venv/bin/python

.venv/.ready: pyproject.toml
	python3 -m venv --system-site-packages .venv
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q triton==3.6.0
	$(PY) -m pip install -q -e ".[test,bench,examples]"
	touch $@

.PHONY: run test lint
run: .venv/.ready
	$(PY) examples/train_moe.py

# Kernels run in Triton's interpreter on CPU; GPU tests (`-m gpu`) skip without CUDA. Two
# worker processes (pytest-xdist), each taking whole files: the interpreter is single-threaded.
test: .venv/.ready
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not gpu" -n 2 --dist loadfile

lint: .venv/.ready
	$(PY) -m ruff check . && $(PY) -m ruff format --check .
