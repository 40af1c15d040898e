"""Activation checkpointing with float8 layers: a selective-checkpoint policy that keeps the
float8 work, and how a layer tells a recomputed forward from a new one.

Full activation checkpointing (``torch.utils.checkpoint``, ``checkpoint_wrapper``) needs
nothing from float8kit: a recomputed forward casts the same input with the same scale
(dynamic scales come from the same amax; DELAYED and STATIC ones from buffers that only
``precompute_scales`` / ``calibrate`` change), so backward gets bitwise the float8 tensors
the first forward made (tests/test_checkpointing.py checks every recipe, eager and compiled).

Selective (op-level) checkpointing chooses per op what to keep. ``checkpoint_policy`` keeps
the float8 gemm outputs and the float8 casts, as torchtitan's op-level list keeps
``_scaled_mm``; the rest of the block (norms, activations, the casts' elementwise math) is
recomputed::

    from functools import partial
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context_fn = partial(create_selective_checkpoint_contexts, float8kit.checkpoint_policy())
    out = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.utils.checkpoint import CheckpointPolicy

import float8kit.gemm  # noqa: F401  (registers float8kit::grouped_mm_fp32)
from float8kit.config import FP8_DTYPES
from float8kit.tensor import Float8TrainingTensor

_aten = torch.ops.aten
# MoE experts (experts.py, through gemm.scaled_grouped_mm): CUDA's float8 grouped kernel, or
# its emulation (float8kit::grouped_mm_fp32, float8kit's own op, fed float8 values only).
_FLOAT8_GROUPED_GEMMS = frozenset(
    {_aten._scaled_grouped_mm.default, torch.ops.float8kit.grouped_mm_fp32.default}
)


def _is_float8_gemm(op, args) -> bool:
    # Eager, the policy sees our subclass's mm (its __torch_dispatch__ calls _scaled_mm out
    # of the policy's sight); compiled, the subclass is traced away and _scaled_mm remains.
    if op is _aten._scaled_mm.default or op in _FLOAT8_GROUPED_GEMMS:
        return True
    return op is _aten.mm.default and any(isinstance(a, Float8TrainingTensor) for a in args)


def _is_float8_cast(op, args, kwargs) -> bool:
    # The last op of every cast (scaling.to_fp8_saturated): hp -> float8 data. Compiled
    # graphs may spell it as the prims conversion.
    if op is _aten._to_copy.default:
        return kwargs.get("dtype") in FP8_DTYPES
    if op is torch.ops.prims.convert_element_type.default:
        return len(args) > 1 and args[1] in FP8_DTYPES
    return False


def checkpoint_policy(
    save_ops: Iterable[torch._ops.OpOverload] = (),
) -> Callable[..., CheckpointPolicy]:
    """A selective activation checkpointing policy that keeps float8 work for backward.

    For ``torch.utils.checkpoint.create_selective_checkpoint_contexts(policy)`` (the
    ``context_fn`` of ``checkpoint(..., use_reentrant=False)`` or ``checkpoint_wrapper``).
    ``MUST_SAVE``: the output of every float8 gemm (a ``Float8Linear``'s forward gemm, a
    float8 expert weight's grouped gemm: ``torch._scaled_grouped_mm`` or its emulation) and
    the float8 data of every cast (1 byte per element: what the layer saves for backward
    anyway, so the recomputed forward reuses it instead of casting again); also the ops in
    ``save_ops``. ``PREFER_RECOMPUTE``: everything else. Gradients are bitwise those of the
    same model without checkpointing.

    Args:
        save_ops: more ops to keep, e.g. ``{torch.ops.aten._scaled_dot_product_flash_attention
            .default}`` or ``{torch.ops.aten.mm.default}`` for the hp matmuls too.

    Returns:
        ``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy``.
    """
    extra = frozenset(save_ops)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in extra or _is_float8_gemm(op, args) or _is_float8_cast(op, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def is_recomputing() -> bool:
    """Whether an eager forward runs as the recomputation of activation checkpointing (inside
    the backward pass), not as a new forward. Compiled graphs recompute inside the compiled
    backward, never by running the Python forward again: False while compiling."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1
