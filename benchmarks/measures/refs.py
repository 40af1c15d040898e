"""The references every measurement compares against: SQNR and an fp32 forward/backward."""

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
