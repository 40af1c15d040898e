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


def _storages(t: torch.Tensor):
    """The plain tensors holding ``t``'s memory (a subclass's inner tensors, recursively)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not nn.Parameter:
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _storages(getattr(t, name))
    else:
        yield t


@contextlib.contextmanager
def saved_bytes(exclude: nn.Module | None = None):
    """Yields a dict whose ``"bytes"`` becomes the memory that autograd keeps for backward
    from what runs in the context: every saved tensor's storage (a float8 tensor's fp8 data
    and scale, not the hp size it reports), each storage counted once, less the storages of
    ``exclude``'s parameters (kept anyway). Also ``"tensors"``: how many were saved."""
    skip = set()
    if exclude is not None:
        skip = {p.untyped_storage().data_ptr() for p in exclude.parameters()}
    seen: dict[int, int] = {}
    result = {"bytes": 0, "tensors": 0}

    def pack(t):
        result["tensors"] += 1
        for inner in _storages(t):
            storage = inner.untyped_storage()
            if storage.data_ptr() not in skip:
                seen[storage.data_ptr()] = storage.nbytes()
        result["bytes"] = sum(seen.values())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
