# Two commands on a fresh machine:
#   make demo   set up .venv and run the main job (float8 vs hp training on CPU, 3 seeds each)
#   make test   set up .venv and run the test suite
# and for maintainers:
#   make lint     ruff (pinned in pyproject's dev extra): lint everything, check formatting
#   make numbers  re-measure every number the docs publish (numbers/*.json), re-render the docs
#   make test-torch TORCH=2.11.0   the suite under another torch (a cached venv outside the repo)
#   make test-fake-cuda            every CUDA code path traced without a GPU (torch 2.11.0 CUDA)
# torch: reused when the Python running this already has it (GPU machines); otherwise the
# CPU build torch==2.13.0 from torch's CPU index (never PyPI's multi-GB CUDA wheels), or,
# where that index is unreachable, from pip's configured sources (a local wheel folder).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# make test's pytest workers (pytest-xdist), each test file whole on one (its module fixtures
# start their gloo groups once): one worker leaves a core idle while dynamo traces, inductor
# compiles a kernel or a test waits on its ranks. WORKERS=0: one process, as before.
WORKERS ?= 2

.PHONY: setup demo test lint numbers clean test-torch test-fake-cuda

setup: $(STAMP)

# torch's CPU wheels: where this index answers, torch comes from it (PyPI's torch is the CUDA
# build, with GBs of nvidia packages); where it does not (offline, a local wheel folder or
# mirror in pip's config), pip's own configuration serves torch==2.13.0.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
CPU_INDEX_UP := $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)"

$(STAMP): pyproject.toml
	$(PY) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || \
		if $(CPU_INDEX_UP) 2>/dev/null; then \
			$(BIN)/pip install -q --index-url $(TORCH_CPU_INDEX) torch==2.13.0; \
		else \
			echo "$(TORCH_CPU_INDEX) unreachable: torch==2.13.0 from pip's configured sources"; \
			$(BIN)/pip install -q torch==2.13.0; \
		fi
	$(BIN)/pip install -q -e ".[test,recipes,dev]"
	# torchtitan (tests/test_integrations_torchtitan.py) without its declared deps: the test
	# extra lists the few its imports need. It requires Python >= 3.11.
	if $(BIN)/python -c "import sys; sys.exit(sys.version_info < (3, 11))"; then \
		$(BIN)/pip install -q --no-deps torchtitan==0.3.0; fi
	@$(BIN)/python -c "import torch, torchao; print('torch', torch.__version__, '| torchao', torchao.__version__)" 2>/dev/null | tail -1
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python recipes/compare.py --preset small --out runs/demo --overwrite

# pytest exits 5 when it collected no test: that is a failure for us.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

FORMATTED := float8kit tests recipes benchmarks tools
lint: $(STAMP)
	$(BIN)/ruff check float8kit tests recipes benchmarks tools
	$(BIN)/ruff format --check $(FORMATTED)

# Measures on a clean checkout only (commit first), so every number names its commit.
numbers: $(STAMP)
	$(BIN)/python tools/measure.py
	$(BIN)/python tools/publish.py

# Another torch release, in a venv cached outside the repo (~/.cache/float8kit/venv-torch-X):
# the PyPI wheel (for 2.11.0 the CUDA 13 build, ~5 GB once, which imports and runs the CPU
# suite without a GPU and also serves test-fake-cuda). TEST_FILES picks files (default: all).
TORCH ?= 2.11.0
TORCH_VENV := $(HOME)/.cache/float8kit/venv-torch-$(TORCH)
TEST_FILES ?=
# what the suite needs besides torch: pyproject's test and recipes extras (float8kit itself
# is imported from the checkout), less triton (a CUDA torch wheel pins its own; torchtitan,
# which needs it, is not installed here, so its tests skip); re-installed when pyproject.toml
# changes
EXTRAS_REQS := $(PY) -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb")); \
	x = d["project"]["optional-dependencies"]; \
	print("\n".join(r for r in x["test"] + x["recipes"] if not r.startswith("triton")))'
$(TORCH_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(TORCH_VENV)
	$(EXTRAS_REQS) > $(TORCH_VENV)/extras.txt
	PIP_CONSTRAINT= $(TORCH_VENV)/bin/pip install -q "torch==$(TORCH)" -r $(TORCH_VENV)/extras.txt
	touch $@

test-torch: $(TORCH_VENV)/.installed
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(TORCH_VENV)/bin/python -m pytest -q \
		-p no:cacheprovider $(PYTEST_ARGS) $(TEST_FILES); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# The fake-CUDA lane: FakeTensorMode on device cuda (tests/test_fake_cuda.py); it must not skip.
test-fake-cuda:
	$(MAKE) test-torch TORCH=2.11.0 TEST_FILES=tests/test_fake_cuda.py PYTEST_ARGS="-rs"
	$(HOME)/.cache/float8kit/venv-torch-2.11.0/bin/python -c \
		"import torch, sys; sys.exit(0 if torch.backends.cuda.is_built() else 'not a CUDA build')"

clean:
	rm -rf $(VENV) .pytest_cache
