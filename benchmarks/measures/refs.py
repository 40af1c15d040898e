"""The references every measurement compares against: SQNR and an fp32 forward/backward."""

import torch
from torch import nn

from benchmarks.common import sqnr_db as sqnr  # noqa: F401  (the one SQNR, in dB, fp64 math)


def fwd_bwd(module: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    """Run forward+backward; return output, grad_input and the grads of every parameter."""
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.backward(grad.to(out.dtype))
    grads = {n.removeprefix("_orig_mod."): p.grad.detach() for n, p in module.named_parameters()}
    return out.detach(), x.grad.detach(), grads


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN payloads and -0 included), same shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = _BITS[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
