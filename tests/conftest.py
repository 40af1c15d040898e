import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from float8kit import versions


def pytest_collection_modifyitems(config, items):
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
