import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from float8kit import versions

# Under pytest-xdist with two or more workers (make test), each worker runs one torch thread
# unless OMP_NUM_THREADS says otherwise, and so does every process a test starts: the
# workers already fill the cores, and a second OpenMP thread per worker only spins against
# the other worker and the ranks and compilers the tests start.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# What importing torch and float8kit left behind lives until the process ends: out of the
# garbage collector's reach, no full collection scans it again (inductor's code generation
# collects often while a compile test runs).
gc.collect()
gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # the interpreter's teardown collects it all, as without the freeze


# The files that take longest, longest first (from a cold-cache `--durations` profile of the
# suite): xdist's loadfile hands out files in collection order, so these start first and the
# last files a worker runs are short ones, not one long file that the other workers wait on.
LONGEST_FIRST = (
    "test_recipes.py",
    "test_checkpointing.py",
    "test_tp.py",
    "test_experts.py",
    "test_compile.py",
    "test_fsdp.py",
    "test_benchmarks.py",
    "test_fsdp_rowwise.py",
    "test_docs.py",
    "test_nvfp4.py",
    "test_quantized_rows.py",
    "test_integrations_hf.py",
    "test_monitor.py",
    "test_memory_blocks.py",
)

_GONE = [name for name in LONGEST_FIRST if not (Path(__file__).parent / name).exists()]
assert not _GONE, f"tests/conftest.py LONGEST_FIRST names files that are gone: {_GONE}"


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: else as found
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on an H100)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def pretend_gpu(monkeypatch):
    """``pretend_gpu((9, 0))``: torch.cuda reports one GPU of that capability (an "NVIDIA
    H200") to float8kit's probes on a machine without one; the probes' cache is emptied
    after the test, so no pretended answer outlives it."""

    def pretend(capability: tuple[int, int], name: str = "NVIDIA H200") -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
        versions._capability_of.cache_clear()

    yield pretend
    versions._capability_of.cache_clear()


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group in this process (its mesh)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
