"""Shared test references: SQNR, fp32 reference layers, a gemm-kernel call counter."""

import contextlib
import copy

import torch
from torch import nn


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
def peer_on_our_cpu_kernel():
    """Run torchao.float8's ``torch._scaled_mm`` calls on float8kit's CPU kernel (oneDNN off
    for the call, ``float8kit::cpu_scaled_mm``), so a bitwise comparison compares the two
    libraries, not two CPU kernels: on AVX512-FP16/AMX CPUs torch hands e4m3 x e4m3 to
    oneDNN's reference matmul, which sums in another order (and 1000x slower)."""
    real = torch._scaled_mm

    def patched(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, **kw):
        inside_ours = not torch.compiler.is_compiling() and not torch._C._get_mkldnn_enabled()
        if a.is_cuda or bias is not None or scale_result is not None or inside_ours:
            return real(a, b, scale_a, scale_b, bias, scale_result, out_dtype, **kw)
        return torch.ops.float8kit.cpu_scaled_mm(
            a, b, scale_a, scale_b, out_dtype, kw.get("use_fast_accum", False)
        )

    torch._scaled_mm = patched
    try:
        yield
    finally:
        torch._scaled_mm = real


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
