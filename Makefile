# One-command entry points (see README.md). `make run` and `make test` install first (skipped when up to date).
# The stack is ARPO_REQUIREMENTS (requirements.txt: CPU, the default; requirements-gpu.txt: CUDA) or, once installed,
# the one $(VENV) holds: scripts/install_stamp.sh keeps it, reinstalls it when its inputs change, and refuses to lay
# the other stack over it.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`: on 2 cores two workers overlap one test's start-ups and waits with another's work
TEST_WORKERS ?= 2

.PHONY: install install-bench run run-tiny test test-fast bench clean

install:
	@bash scripts/install_stamp.sh ensure $(VENV)

# The suite's parity test and the peer benchmark need TRL (requirements-bench.txt), which training does not
install-bench: install $(VENV)/.arpo-bench-installed

$(VENV)/.arpo-bench-installed: requirements-bench.txt
	$(PY) -m uv pip install -q --python $(PY) -r requirements-bench.txt
	@bash scripts/compile_bytecode.sh $(VENV)
	@touch $@

# The real-model reproduction (SmolLM2-135M-Instruct): convert, SFT, ARPO, validation before/after with the gain's
# 95% CI as the last line (outputs/smollm2_arpo; 2 cores: ~30 min with AVX-512/AMX, 1.5-2 h AVX2-only). ARGS passes overrides or --output-dir.
run: install
	$(PY) -m arpo.pipeline --preset smollm2 $(ARGS)

# The fast preset: the project's 3M-parameter tiny model end to end (outputs/tiny_arpo; minutes).
run-tiny: install
	$(PY) -m arpo.pipeline --preset tiny $(ARGS)

# The whole suite, slow tests (real vLLM, Ray, FSDP2, SFT) included. pytest's exit 5 (nothing collected) is an error.
# The 20 slowest tests are listed at the end, to keep the suite's time in view.
test: install-bench
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=20 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf outputs .pytest_cache
