"""Every custom op float8kit registers (``torch.ops.float8kit``) passes
``torch.library.opcheck``: schema, fake (shapes, dtypes and strides of its outputs) and
autograd registration agree with the real kernel, on the arguments float8kit really passes it.

The arguments are captured from real workloads (a Float8Linear per recipe, with a transposed
weight and a transposed input, delayed scaling with ``precompute_scales``, float8 experts),
so a new op, or a new way of calling one, is checked without editing this file; an op the
workloads never reach fails ``test_every_op_is_reached``. A fake that disagrees with its
kernel crashes a compiled graph (``assert_size_stride``) or silently miscompiles it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.measures.experts import OFFS, TOKENS, Experts
from float8kit import (
    Float8ExpertsConfig,
    Float8LinearConfig,
    Float8Recipe,
    convert_experts_to_float8_training,
    convert_to_float8_training,
    precompute_scales,
)
from float8kit.config import E4M3, FP8_DTYPES
from float8kit.formats.mx import _to_mx_last_dim

# every named recipe (the registry's, not a hand-kept list)
LINEAR_RECIPES = [r.value for r in Float8Recipe]
EXPERT_RECIPES = ["rowwise", "mxfp8"]
ALL_UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)


def float8kit_ops() -> list[str]:
    """Every op of the float8kit namespace registered in this process."""
    import float8kit  # noqa: F401  (registers them)

    names = torch._C._dispatch_get_all_op_names()
    return sorted(n.split("::")[1] for n in names if n.startswith("float8kit::"))


class _Capture(TorchDispatchMode):
    """Records the arguments of each float8kit op call (the first few per op and layout)."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, list] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is not torch.Tensor for t in types):
            # a float8 tensor's op: its own dispatch runs it, under this mode
            return NotImplemented
        if func.namespace == "float8kit":
            seen = self.calls.setdefault(func.__name__.split(".")[0], [])
            key = [tuple(a.stride()) for a in args if isinstance(a, torch.Tensor)]
            if len(seen) < 12 and key not in [k for k, _, _ in seen]:
                clone = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
                seen.append((key, func, (clone, dict(kwargs))))
        return func(*args, **kwargs)


def _linear_workloads():
    for recipe in LINEAR_RECIPES:
        config = Float8LinearConfig.from_recipe_name(recipe)
        for transposed in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, 96, bias=False))
            if transposed:  # a weight made as nn.Parameter(w.t()): column-major
                w = model[0].weight.detach()
                model[0].weight = nn.Parameter(w.t().contiguous().t())
            convert_to_float8_training(model, config=config, module_filter_fn=lambda *_: True)
            x = torch.randn(64, 32).t() if transposed else torch.randn(32, 64)
            x.requires_grad_()
            model(x).sum().backward()
            precompute_scales(model)


def _expert_workloads():
    for recipe in EXPERT_RECIPES:
        torch.manual_seed(0)
        model = convert_experts_to_float8_training(
            Experts(), config=Float8ExpertsConfig.from_recipe_name(recipe)
        )
        x = torch.randn(TOKENS, model.w1.shape[1], requires_grad=True)
        model(x, OFFS).backward(torch.randn(TOKENS, model.w2.shape[2]))


@pytest.fixture(scope="module")
def captured() -> dict[str, list]:
    capture = _Capture()
    with capture:
        _linear_workloads()
        _expert_workloads()
        # the MX cast a compiled graph calls opaque where inductor cannot fuse it (CPU)
        for hp in (torch.randn(48, 96), torch.randn(96, 48).t()):
            _to_mx_last_dim(hp.to(torch.bfloat16), E4M3, "rceil")
        # the fp32 grouped gemm inside the emulated one (ops an op calls are not seen)
        for _, _, ((a, _, b, _, offs), _) in capture.calls["emulated_grouped_mm"]:
            torch.ops.float8kit.grouped_mm_fp32(a.float(), b.float(), offs)
    return capture.calls


def test_every_op_is_reached(captured):
    assert sorted(captured) == float8kit_ops()


@pytest.mark.parametrize("op", float8kit_ops())
def test_opcheck(captured, op):
    calls = captured.get(op)
    assert calls, f"float8kit::{op} was not reached by the workloads"
    for _, func, (args, kwargs) in calls:
        # test_schema compares inputs with ops float8 has no CPU kernel for (mul): the
        # schema's mutation claims of an op with float8 inputs are checked by the others
        # (test_aot_dispatch_dynamic functionalizes it)
        fp8_in = any(isinstance(a, torch.Tensor) and a.dtype in FP8_DTYPES for a in args)
        utils = [u for u in ALL_UTILS if not (fp8_in and u == "test_schema")]
        torch.library.opcheck(func, args, kwargs, test_utils=utils)
