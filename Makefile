# One-command entry points (see README.md). `make run` and `make test` install first (skipped when up to date).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.arpo-installed
OUT ?= outputs/tiny_arpo
PYTEST_ARGS ?=

.PHONY: install run test test-fast bench clean

$(STAMP): requirements.txt pyproject.toml scripts/install.sh
	bash scripts/install.sh
	touch $(STAMP)

install: $(STAMP)

# The tiny end-to-end ARPO reproduction on this machine.
run: install
	$(PY) -m arpo.pipeline --output-dir $(OUT)

# The whole suite, slow tests (real vLLM, Ray, FSDP2, SFT) included. pytest's exit 5 (nothing collected) is an error.
# The 20 slowest tests are listed at the end, to keep the suite's time in view.
test: install
	$(PY) -m pytest -q --durations=20 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf outputs .pytest_cache
