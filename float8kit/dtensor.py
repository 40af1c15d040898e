"""Float8 casts of DTensors (tensor parallel): a DTensor around a float8 local tensor.

Under tensor parallelism (``parallelize_module`` with torch's or float8kit's TP styles) a
``Float8Linear`` sees DTensor inputs, weights and grad_outputs. A cast of a DTensor returns a
DTensor whose local tensor is a ``Float8TrainingTensor`` (the layout torchao uses too): the
DTensor keeps the sharding, the float8 tensor the bytes and the scale. The scale is a plain
local tensor, never a DTensor, so the gemm (``gemm.py``) only ever sees local operands, and
DTensor's sharding propagation runs on the hp metadata the float8 tensor reports.

Scales. A tensorwise scale comes from the amax of the *whole* tensor (one small all-reduce
over the mesh when the tensor is sharded), so every rank casts with the same scale: the
result equals casting the unsharded tensor, and the float8 shards can be all-gathered as
bytes (``float8kit.tp``). An axiswise scale is one per slice along the gemm's inner dim:
local where that dim is not sharded (rowwise input scales are per token: no collective),
all-reduced across the ranks that share a slice where it is. Blockwise scales are per
block: each rank casts its own shard in its own blocks, with no collective.

Internal: ``cast_to_float8`` in ``linear.py`` sends DTensors here.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from float8kit.config import (
    CastConfig,
    Float8LinearConfig,
    GemmRole,
    ScalingGranularity,
    ScalingType,
)
from float8kit.scaling import amax as local_amax
from float8kit.tensor import Float8TrainingTensor, hp_to_float8


def is_float8(t: torch.Tensor) -> bool:
    """Whether ``t`` is float8: a ``Float8TrainingTensor`` or a DTensor around one."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    return isinstance(t, Float8TrainingTensor)


def dequantize(t: torch.Tensor) -> torch.Tensor:
    """The hp tensor a float8 ``t`` stands for (a DTensor stays a DTensor); others as is."""
    if isinstance(t, DTensor) and isinstance(t._local_tensor, Float8TrainingTensor):
        return wrap_local(t._local_tensor.dequantize(), t)
    return t.dequantize() if isinstance(t, Float8TrainingTensor) else t


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local tensor (same storage); anything else as is."""
    return t.to_local() if isinstance(t, DTensor) else t


def wrap_local(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as the local tensor of a DTensor with ``like``'s mesh, placements, shape."""
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=_stride(like),
    )


def _stride(t: DTensor) -> tuple[int, ...]:
    """``t``'s stride; under torch.compile the contiguous stride of its shape.

    Dynamo traces an autograd Function's backward in a strict mode where the strides of
    gradients are unknown: reading one (``.stride()``) makes it give up that trace and
    retrace the backward on ``.contiguous()`` gradients, and in torch 2.13 the abandoned
    trace leaves ``_Float8Matmul.backward``'s ``torch.autocast(enabled=False)`` entered, so
    the rest of the forward traces as if autocast were off (a compiled block's wk/wv then
    ran in fp32 under bf16 autocast). The shape is read, never the stride: the tensors
    wrapped here (casts and dequantizations of row-major activations, gradients and
    weights) are contiguous, whose stride follows from the shape."""
    if torch.compiler.is_compiling():
        stride, n = [], 1
        for size in reversed(t.shape):
            stride.append(n)
            n *= max(size, 1)
        return tuple(reversed(stride))
    return t.stride()


def amax(hp: DTensor, reduce_dim: int | None) -> torch.Tensor:
    """max(|hp|) of a DTensor as a plain local tensor: the whole tensor's (shape ())
    when ``reduce_dim`` is None, else one per slice along ``reduce_dim`` for this rank's
    rows (reduced over the ranks that hold parts of the same slice)."""
    if hp.numel() == 0:
        shape = [] if reduce_dim is None else [*hp.to_local().shape]
        if reduce_dim is not None:
            shape[reduce_dim] = 1
        return torch.zeros(shape, dtype=torch.float32, device=hp.device)
    result = local_amax(hp, reduce_dim)
    # A reduction over a sharded dim is Partial(max): all-reduce it; Shard of other dims
    # stays (the scale of this rank's rows only).
    placements = [Replicate() if p.is_partial() else p for p in result.placements]
    return result.redistribute(placements=placements).to_local()


def cast_to_float8(
    hp: DTensor,
    cast: CastConfig,
    role: GemmRole,
    reduce_dim: int,
    config: Float8LinearConfig,
    state_scale: torch.Tensor | None = None,
    amax_record: torch.Tensor | None = None,
    scale_set: bool = False,
) -> DTensor:
    """``linear.cast_to_float8`` for a DTensor: the same scale decision (``operand_scale``)
    with the amax of the whole tensor (see the module docstring), applied to the local
    tensor; returns a DTensor of the same layout around the ``Float8TrainingTensor``."""
    from float8kit.linear import needs_amax, operand_scale

    if any(p.is_partial() for p in hp.placements):
        # Casting is not linear: partial sums must be added up in hp first.
        hp = hp.redistribute(
            placements=[Replicate() if p.is_partial() else p for p in hp.placements]
        )
    if cast.scaling_granularity is ScalingGranularity.BLOCKWISE:
        # Every block's scale is its own: each rank casts its shard in blocks of its own
        # (a partial block at a shard edge is zero-padded, as at a tensor edge), which is a
        # blockwise cast of the local operand the local gemm uses. No collective.
        from float8kit.linear import cast_to_float8 as cast_local

        return wrap_local(cast_local(hp.to_local(), cast, role, reduce_dim, config), hp)
    # DELAYED/STATIC buffers: parallelize_module replicates them as DTensors; the local
    # tensor shares their storage, so a recorded amax lands in the buffer.
    state_scale, amax_record = local(state_scale), local(amax_record)
    axiswise = cast.scaling_granularity is ScalingGranularity.AXISWISE
    dim = (reduce_dim % hp.dim()) if axiswise else None
    amax_value = None
    if needs_amax(cast, amax_record is not None, scale_set):
        amax_value = amax(hp, dim)
    scale = operand_scale(cast, role, config, amax_value, state_scale, amax_record, scale_set)
    fp8 = hp_to_float8(
        hp.to_local(),
        scale,
        cast.dtype_for(role),
        role,
        dim,
        config,
        guard_non_finite=cast.scaling_type is not ScalingType.DYNAMIC,
    )
    return wrap_local(fp8, hp)
