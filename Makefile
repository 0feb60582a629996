# Two commands set up a fresh machine (Python >= 3.10, no GPU needed):
#   make quickstart   create .venv, install, build a tiny model, run configs/quickstart.yaml
#   make test         create .venv, install with test extras, run the test suite
#   make test-quick   the suite without the tests marked slow (end-to-end runs, Ray start-ups, compiles)
#                     and the GPU tests: the inner loop
#   make test-all     the whole suite, the tests marked long included (learning claims, the healing
#                     scenario, each chaos config killed once and resumed, the end-to-end scenarios and
#                     compiles of a minute or more beside a busy core: ~40 minutes more): what CI runs
#                     (.ci/run); make test-long runs those alone
#   make chaos        each of three configs killed (SIGKILL) at five moments and resumed, compared with its
#                     uninterrupted run (~25 minutes on 2 cores; benchmarks/recovery/chaos.py): benchmarks/results/chaos.md
#   make data         build the tiny model and the datasets the offline configs read (dpo, kto_offline, rm, qa_ppo),
#                     and the 4M-parameter char model configs/tool_calc.yaml trains
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch. Elsewhere, e.g.:  make TORCH="torch --index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0
EXTRAS ?= test
MODEL ?= artifacts/tiny-char
SMALL ?= artifacts/small-char

.PHONY: install quickstart test test-quick test-long test-all chaos data clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-$(EXTRAS): setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed-$(EXTRAS)

$(MODEL)/config.json: | install
	$(BIN)/xrlhf make-tiny-model $(MODEL) --preset tiny

quickstart: install $(MODEL)/config.json
	$(BIN)/xrlhf run configs/quickstart.yaml

$(SMALL)/config.json: | install
	$(BIN)/xrlhf make-tiny-model $(SMALL) --preset small

data: install $(MODEL)/config.json $(SMALL)/config.json
	$(BIN)/xrlhf prepare-data

test: install
	$(BIN)/python -m pytest -q -m "not long" --durations=40

test-long: install
	$(BIN)/python -m pytest -q -m long --durations=10

test-all: install
	$(BIN)/python -m pytest -q --durations=40

chaos: install $(MODEL)/config.json
	$(BIN)/python -m benchmarks.recovery chaos --model $(MODEL) --out benchmarks/results

test-quick: install
	$(BIN)/python -m pytest -q -m "not slow and not gpu" --durations=10

clean:
	rm -rf $(VENV) artifacts runs .pytest_cache
