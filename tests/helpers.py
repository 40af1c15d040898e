"""Shared test references: fp32 reference layers, a gemm-kernel call counter; SQNR and the
fp32 forward/backward come from the measuring code (benchmarks/measures/refs.py)."""

import contextlib
import copy
import sys
from pathlib import Path

import torch
from torch import nn

# the peer's CPU kernel routing lives with the benchmarks, which need it too
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import peer_on_our_cpu_kernel  # noqa: E402, F401

from benchmarks.measures.refs import fwd_bwd, sqnr  # noqa: E402, F401


def fp32_copy(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module).float()


@contextlib.contextmanager
def count_scaled_mm():
    """Yields a list that gets one entry (the operand shapes) per ``torch._scaled_mm`` call
    made while the context is active (eager)."""
    calls, real = [], torch._scaled_mm

    def counting(a, b, *args, **kwargs):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, *args, **kwargs)

    torch._scaled_mm = counting
    try:
        yield calls
    finally:
        torch._scaled_mm = real


class OnCuda(torch.Tensor):
    """A CPU tensor that says it is on cuda:0 (``t.as_subclass(OnCuda)``): it drives
    float8kit's CUDA branches on a machine without a GPU, up to a kernel call a test spies on."""

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


# torch 2.11's inductor does not keep eager's roundings in every fused kernel on CPU (with
# emulate_precision_casts on, e.g. an activation between two float8 layers): its compiled
# float8 models differ from eager by float8 rounding flips. From torch 2.13 on, bitwise.
COMPILE_IS_BITWISE = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13)
OLD_TORCH_COMPILE_SQNR_DB = 30  # well above the ~20-25 dB of float8 against fp32


def assert_compiled_matches_eager(eager: torch.Tensor, compiled: torch.Tensor, what: str = ""):
    """Bitwise on torch >= 2.13; on older torch, within float8 rounding (SQNR)."""
    if COMPILE_IS_BITWISE:
        assert torch.equal(eager, compiled), what
    else:
        assert sqnr(eager, compiled) >= OLD_TORCH_COMPILE_SQNR_DB, what


def run_train(tmp: Path, *flags: str) -> list[dict]:
    """recipes/train.py's main in this process (tiny preset); returns the records it wrote to
    metrics.jsonl."""
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    import train

    records = train.main(["--preset", "tiny", "--quiet", "--out", str(tmp), *flags])
    on_disk = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    assert on_disk == records
    return records


def blocked_scale_index(h: int, w: int) -> torch.Tensor:
    """Where element (r, c) of an (H, W) MX scale lands in cuBLAS's blocked scale layout,
    written from the cuBLAS docs' formula (not from ``gemm.to_blocked``'s reshapes):
    ``((r // 128) * ceil(W / 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4
    + c % 4``; the layout holds 128 * ceil(H / 128) * 4 * ceil(W / 4) bytes."""
    r = torch.arange(h).reshape(-1, 1)
    c = torch.arange(w).reshape(1, -1)
    tile = (r // 128) * (-(-w // 4)) + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def blocked_scale_reference(scale: torch.Tensor) -> torch.Tensor:
    """The (H, W) uint8 ``scale`` scattered into the blocked layout; padding bytes are 0."""
    h, w = scale.shape
    out = torch.zeros(128 * -(-h // 128) * 4 * -(-w // 4), dtype=torch.uint8)
    out[blocked_scale_index(h, w).reshape(-1)] = scale.reshape(-1).view(torch.uint8)
    return out


def recipes(ok=lambda caps: True) -> list[str]:
    """The named recipes (in ``Float8Recipe``'s order) whose every enabled cast is in a format
    whose capabilities ``ok`` accepts. The recipe lists the tests parametrize over come from
    the format registry this way: a new format or recipe reaches each test it qualifies for
    without editing the test."""
    from float8kit import Float8LinearConfig, Float8Recipe, formats

    fine = set(formats.supporting(ok))
    return [
        r.value
        for r in Float8Recipe
        if all(
            c.scaling_granularity.value in fine
            for _, c in formats.enabled_casts(Float8LinearConfig.from_recipe_name(r))
        )
    ]
