# Two commands on a fresh machine:
#   make demo   set up .venv and run the main job (float8 vs bf16 training on CPU)
#   make test   set up .venv and run the test suite
# and for maintainers:
#   make lint     ruff (pinned in pyproject's dev extra): lint everything, check formatting
#   make numbers  re-measure every number the docs publish (numbers/*.json), re-render the docs
# torch: reused when the Python running this already has it (GPU machines); otherwise the
# CPU build torch==2.13.0 is installed (never the multi-GB CUDA wheels).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: setup demo test lint numbers clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,recipes,dev]"
	@$(BIN)/python -c "import torch, torchao; print('torch', torch.__version__, '| torchao', torchao.__version__)" 2>/dev/null | tail -1
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python recipes/compare.py --preset small --out runs/demo --overwrite

# pytest exits 5 when it collected no test: that is a failure for us.
test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

FORMATTED := float8kit tests recipes benchmarks tools
lint: $(STAMP)
	$(BIN)/ruff check float8kit tests recipes benchmarks tools
	$(BIN)/ruff format --check $(FORMATTED)

# Measures on a clean checkout only (commit first), so every number names its commit.
numbers: $(STAMP)
	$(BIN)/python tools/measure.py
	$(BIN)/python tools/publish.py

clean:
	rm -rf $(VENV) .pytest_cache
