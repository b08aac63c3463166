# make demo: set up, plan examples/gpt.py for cpu:4, run the emitted script with --verify.
# make test: set up, lint, run the default tier (what CI runs: everything not marked slow),
#   in JOBS pytest-xdist workers (default 2, the CI machine's cores; JOBS=0 runs in one process).
# make test-all: the same plus the slow tier (tests over ~15 s that the default tier covers in part).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
OUT ?= out/demo
JOBS ?= 2

.PHONY: setup demo test test-all lint format clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,hf,viz]'
	touch $@

setup: $(BIN)/.installed

demo: setup
	rm -rf $(OUT)
	$(BIN)/plan examples/gpt.py --cluster cpu:4 --global-batch 8 --seq-len 64 --out $(OUT)
	$(BIN)/torchrun --standalone --nproc-per-node 4 $(OUT)/train.py --steps 5 --verify

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: lint
	$(BIN)/pytest -q -x -m "not slow" -n $(JOBS) --dist loadfile --durations=40

test-all: lint
	$(BIN)/pytest -q -x -n $(JOBS) --dist loadfile --durations=40

clean:
	rm -rf $(VENV) out build *.egg-info
