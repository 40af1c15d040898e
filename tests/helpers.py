"""Shared test references: SQNR, fp32 reference layers, a gemm-kernel call counter."""

import contextlib
import copy
import sys
from pathlib import Path

import torch
from torch import nn

# the peer's CPU kernel routing lives with the benchmarks, which need it too
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import peer_on_our_cpu_kernel  # noqa: E402, F401


def sqnr(ref: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``actual`` against ``ref``, in dB (fp64 math)."""
    ref, actual = ref.detach().double(), actual.detach().double()
    noise = (ref - actual).norm()
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(ref.norm() / noise))


def fwd_bwd(module: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    """Run forward+backward; return output, grad_input and the grads of every parameter."""
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.backward(grad.to(out.dtype))
    grads = {n.removeprefix("_orig_mod."): p.grad.detach() for n, p in module.named_parameters()}
    return out.detach(), x.grad.detach(), grads


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
