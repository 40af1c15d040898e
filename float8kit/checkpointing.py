"""Activation checkpointing with float8 layers: a selective-checkpoint policy that keeps the
float8 work, and how a layer tells a recomputed forward from a new one.

Full activation checkpointing (``torch.utils.checkpoint``, ``checkpoint_wrapper``) needs
nothing from float8kit: a recomputed forward casts the same input with the same scale
(dynamic scales come from the same amax; DELAYED and STATIC ones from buffers that only
``precompute_scales`` / ``calibrate`` change), so backward gets bitwise the float8 tensors
the first forward made (tests/test_checkpointing.py checks every recipe, eager and compiled).

Selective (op-level) checkpointing chooses per op what to keep. ``checkpoint_policy`` keeps
the float8 gemm outputs, as torchtitan's op-level list keeps ``_scaled_mm``; the rest of the
block (norms, activations, attention, the float8 casts) is recomputed::

    from functools import partial
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context_fn = partial(create_selective_checkpoint_contexts, float8kit.checkpoint_policy())
    out = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import float8kit.grouped_gemm  # noqa: F401  (registers float8kit::emulated_*grouped_mm)
from float8kit import cast, versions
from float8kit.config import FP8_DTYPES
from float8kit.tensor import Float8TrainingTensor

_aten = torch.ops.aten
# MoE experts (experts.py, through float8kit.grouped_gemm): CUDA's float8 grouped kernel, or
# its emulation (float8kit::emulated_grouped_mm / emulated_mx_grouped_mm, float8kit's own
# opaque ops: float8 operands and their scales in, the kernel's numerics out).
_FLOAT8_GROUPED_GEMMS = frozenset(
    {
        _aten._scaled_grouped_mm.default,
        torch.ops.float8kit.emulated_grouped_mm.default,
        torch.ops.float8kit.emulated_mx_grouped_mm.default,  # MXFP8 experts off CUDA
    }
)


def _is_float8_gemm(op, args) -> bool:
    # Eager, the policy sees our subclass's mm (its __torch_dispatch__ calls _scaled_mm out
    # of the policy's sight); compiled, the subclass is traced away and _scaled_mm remains.
    if op is _aten._scaled_mm.default or op in _FLOAT8_GROUPED_GEMMS:
        return True
    return op is _aten.mm.default and any(isinstance(a, Float8TrainingTensor) for a in args)


def _is_float8_cast(op, args, kwargs) -> bool:
    # The last op of every cast (cast.to_fp8_saturated): hp -> float8 data, or the whole
    # one-pass tensorwise cast (cast.cast_tensorwise). Compiled graphs may spell the former
    # as the prims conversion.
    if op is torch.ops.float8kit.cast_tensorwise.default:
        return True
    if op is _aten._to_copy.default:
        return kwargs.get("dtype") in FP8_DTYPES
    if op is torch.ops.prims.convert_element_type.default:
        return len(args) > 1 and args[1] in FP8_DTYPES
    return False


def checkpoint_policy(
    save_ops: Iterable[torch._ops.OpOverload] = (),
    keep_input_casts: bool = False,
) -> Callable[..., CheckpointPolicy]:
    """A selective activation checkpointing policy that keeps float8 gemm work for backward.

    For ``torch.utils.checkpoint.create_selective_checkpoint_contexts(policy)`` (the
    ``context_fn`` of ``checkpoint(..., use_reentrant=False)`` or ``checkpoint_wrapper``).
    ``MUST_SAVE``: the output of every float8 gemm (a ``Float8Linear``'s forward gemm, a
    float8 expert weight's grouped gemm: ``torch._scaled_grouped_mm`` or its emulation), so
    that backward runs no gemm twice; also the ops in ``save_ops``. ``PREFER_RECOMPUTE``:
    everything else, the float8 casts included: the weight's (a weight-sized float8 tensor
    per layer) and the input's. An input cast reads an hp tensor that the recomputed forward
    makes anyway (a norm's, the attention's or the activation's output, which their own
    backward needs), so recomputing it is one elementwise pass per layer, against keeping
    one byte per element of every float8 layer's input from forward to backward. Gradients
    are bitwise those of the same model without checkpointing (a recomputed cast is bitwise
    the first one: same tensor, same scale).

    Args:
        save_ops: more ops to keep, e.g. ``{torch.ops.aten._scaled_dot_product_flash_attention
            .default}`` or ``{torch.ops.aten.mm.default}`` for the hp matmuls too.
        keep_input_casts: also keep the float8 data of the input casts backward reads (the
            input's copy for the grad_weight gemm; rowwise recomputes its dim-1 copy, which
            only the output gemm reads): no cast of an input in backward, for one byte per
            element kept. Under ``torch.compile`` the policy cannot tell the casts apart and
            then keeps them all.

    Returns:
        ``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy``.
    """
    extra = frozenset(save_ops)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in extra or _is_float8_gemm(op, args):
            return CheckpointPolicy.MUST_SAVE
        if (
            keep_input_casts
            and _is_float8_cast(op, args, kwargs)
            and (cast.kept_casts_running() or versions.compiling())
        ):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def default_norm_filter(module: nn.Module, fqn: str) -> bool:
    """``recompute_norms``' default choice: ``nn.LayerNorm``, ``nn.RMSNorm`` and any module
    whose class name ends in ``RMSNorm`` or ``LayerNorm`` (``LlamaRMSNorm``, the recipes'
    ``RMSNorm``)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(
        ("RMSNorm", "LayerNorm")
    )


_RECOMPUTED_CLASSES: dict[type, type] = {}


def _recomputed_class(cls: type) -> type:
    if cls not in _RECOMPUTED_CLASSES:

        def forward(self, *args, **kwargs):
            if not torch.is_grad_enabled():
                return cls.forward(self, *args, **kwargs)
            return checkpoint(cls.forward, self, *args, use_reentrant=False, **kwargs)

        _RECOMPUTED_CLASSES[cls] = type(
            cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__}
        )
    return _RECOMPUTED_CLASSES[cls]


def recompute_norms(
    module: nn.Module,
    norm_filter: Callable[[nn.Module, str], bool] | None = None,
) -> list[str]:
    """Recompute the norms in backward instead of keeping what they save: each chosen norm
    keeps only its input (the residual stream) for backward.

    Why: a float8 linear keeps a float8 copy of its input, not the hp norm output that feeds
    it, but the norm itself still keeps hp tensors for its own backward (Llama's RMSNorm:
    its input upcast to fp32 and its bf16 output, 6 bytes per element in a bf16 model), which
    cancels most of the float8 saving (the fused norm + cast of Transformer Engine has the
    same motive). A recomputed norm is a cheap elementwise pass in backward. Gradients are
    bitwise unchanged.

    Each chosen module's class is swapped in place for a subclass whose ``forward`` runs the
    original one under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (no change
    to parameters, state_dict keys, hooks or the library that defined the norm). Idempotent.
    Under a block-level checkpoint (``checkpoint_policy``, full AC) the norms are recomputed
    anyway: this is for blocks that are not checkpointed.

    Args:
        module: the model (or a block).
        norm_filter: ``(module, fqn) -> bool``, which modules to recompute;
            ``default_norm_filter`` when None.

    Returns:
        The fqns of the modules that now recompute.
    """
    chosen = default_norm_filter if norm_filter is None else norm_filter
    names = []
    for fqn, mod in module.named_modules():
        if type(mod) in _RECOMPUTED_CLASSES.values():
            names.append(fqn)
        elif chosen(mod, fqn):
            mod.__class__ = _recomputed_class(type(mod))
            names.append(fqn)
    return names
