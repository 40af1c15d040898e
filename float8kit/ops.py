"""The op table of ``Float8TrainingTensor``: each aten op it supports, and nothing else.

An op is registered with ``@implements([aten.op.overload, ...])`` into ``tensor.OP_TABLE``;
the tensor's ``__torch_dispatch__`` raises ``NotImplementedError`` naming any other op, so
nothing silently falls back to hp math.

Metadata ops (view, transpose, slice, ...) act on the fp8 data and keep the scale; with
axiswise scales they transform the scale tensor the same way, and raise where the result
would no longer have one scale per slice of the gemm's inner dim. Blockwise tensors take
transposes (the scale grid and the block shape transpose with the data) and same-shape
views; ops that would cut through a block (slice, split, cat, other views) raise.
"""

from __future__ import annotations

import torch

from float8kit import versions
from float8kit.cast import cast_like
from float8kit.config import FP8_DTYPES, GEMMS, Float8LinearConfig
from float8kit.gemm import GemmPlan, gemm_plan
from float8kit.tensor import OP_TABLE, Float8TrainingTensor

aten = torch.ops.aten


def implements(ops: list):
    """Register the decorated ``fn(func, args, kwargs)`` for each aten op overload."""

    def decorator(fn):
        for op in ops:
            OP_TABLE[op] = fn
        return fn

    return decorator


def supported_ops() -> list:
    """The aten op overloads the table covers (for docs and tests)."""
    return sorted(OP_TABLE, key=str)


# ---------------------------------------------------------------------------- metadata ops


@implements([aten.detach.default, aten.alias.default, aten.clone.default])
def _same_scale(func, args, kwargs):
    t = args[0]
    scale = t._scale.clone() if func is aten.clone.default else t._scale
    return t.with_data(func(t._data, *args[1:], **kwargs), scale)


def _transposed(t: Float8TrainingTensor, data: torch.Tensor, d0: int, d1: int):
    gran, scale = t._gran.transpose(t._scale, d0, d1)
    return t.with_data(data, scale, gran)


@implements([aten.t.default])
def _t(func, args, kwargs):
    t = args[0]
    return _transposed(t, t._data.t(), 0, max(t.dim() - 1, 0))


@implements([aten.transpose.int])
def _transpose(func, args, kwargs):
    t, d0, d1 = args[0], args[1] % args[0].dim(), args[2] % args[0].dim()
    return _transposed(t, t._data.transpose(d0, d1), d0, d1)


@implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
def _view(func, args, kwargs):
    t, shape = args[0], list(args[1])
    data = func(t._data, shape)
    gran, scale = t._gran.view(t._scale, t.shape, data.shape, func)
    return t.with_data(data, scale, gran)


@implements([aten.as_strided.default])
def _as_strided(func, args, kwargs):
    t = args[0]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    data = func(t._data, *args[1:], **kwargs)
    # FSDP2's view of the unsharded weight inside its padded all-gather buffer: the first
    # rows, which keep their scales (row scales, or the first rows of the block grid)
    rows = args[1][0] if _leading_rows(t, args[1], args[2], offset) else None
    scale = t._gran.strided(t._scale, rows, t.dim())
    if scale is None:
        raise NotImplementedError(
            "float8kit: as_strided is tensorwise-only (blockwise and row-scaled: only a 2-D "
            "tensor's leading rows)"
        )
    return t.with_data(data, scale)


def _leading_rows(t: Float8TrainingTensor, size, stride, storage_offset=None) -> bool:
    """Whether ``as_strided(size, stride, storage_offset)`` of a contiguous 2-D tensor
    selects its first ``size[0]`` rows, whole."""
    d = t._data
    return (
        d.dim() == 2
        and d.is_contiguous()
        and len(size) == 2
        and size[0] <= d.shape[0]
        and size[1] == d.shape[1]
        and tuple(stride) == (d.shape[1], 1)
        and (storage_offset or 0) == d.storage_offset()
    )


@implements([aten.slice.Tensor])
def _slice(func, args, kwargs):
    t = args[0]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % t.dim()
    scale = t._gran.sliced(t._scale, dim, lambda s: func(s, *args[1:], **kwargs), func)
    return t.with_data(func(t._data, *args[1:], **kwargs), scale)


@implements([aten.split.Tensor])
def _split(func, args, kwargs):
    t, size = args[0], args[1]
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % t.dim()
    datas = func(t._data, size, dim)
    scales = t._gran.split(t._scale, dim, len(datas), lambda s: func(s, size, dim), func)
    return [t.with_data(d, s) for d, s in zip(datas, scales, strict=True)]


@implements([aten.cat.default])
def _cat(func, args, kwargs):
    tensors = args[0]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % tensors[0].dim()
    first = tensors[0]
    if not all(isinstance(t, Float8TrainingTensor) for t in tensors):
        raise NotImplementedError("float8kit: cat of float8 and hp tensors; dequantize first")
    for t in tensors[1:]:
        if t._data.dtype != first._data.dtype or t._gran != first._gran:
            raise ValueError("float8kit: cat needs the same float8 dtype and granularity")
    scales = [t._scale for t in tensors]
    scale = first._gran.cat(scales, dim, lambda ss: func(ss, dim), func)
    return first.with_data(func([t._data for t in tensors], dim), scale)


@implements([aten.is_same_size.default])
def _is_same_size(func, args, kwargs):
    return args[0].shape == args[1].shape


@implements([aten._pin_memory.default])
def _pin(func, args, kwargs):
    t = args[0]
    return t.with_data(func(t._data, *args[1:], **kwargs), t._scale.pin_memory())


@implements([aten.is_pinned.default])
def _is_pinned(func, args, kwargs):
    return func(args[0]._data, *args[1:], **kwargs)


@implements([aten.empty_like.default])
def _empty_like(func, args, kwargs):
    t = args[0]
    kwargs = {k: v for k, v in kwargs.items() if k != "dtype"}
    return t.with_data(func(t._data, *args[1:], **kwargs), t._scale.clone())


@implements([aten._to_copy.default])
def _to_copy(func, args, kwargs):
    """``.to(dtype/device)``: an hp dtype changes the dtype it stands for (the fp8 data is
    unchanged); a device moves data and scale. A float8 dtype is refused: that would
    reinterpret values, not cast them."""
    t = args[0]
    dtype = kwargs.get("dtype", t._orig_dtype)
    if dtype in FP8_DTYPES:
        raise ValueError("float8kit: .to(float8 dtype) on a Float8TrainingTensor; use ._data")
    device = kwargs.get("device", None)
    data = t._data if device is None else t._data.to(device)
    scale = t._scale if device is None else t._scale.to(device)
    return t.with_data(data, scale, orig_dtype=dtype)


@implements([aten.copy_.default])
def _copy_(func, args, kwargs):
    """Float8 <- Float8 copies data and scale; Float8 <- hp casts with the destination's
    scale; hp <- Float8 dequantizes."""
    dst, src = args[0], args[1]
    if isinstance(dst, Float8TrainingTensor) and isinstance(src, Float8TrainingTensor):
        if dst._data.dtype != src._data.dtype or dst._gran != src._gran:
            raise ValueError("float8kit: copy_ between float8 tensors of different formats")
        dst._data.copy_(src._data)
        dst._scale.copy_(src._scale)
    elif isinstance(dst, Float8TrainingTensor):
        dst._data.copy_(cast_like(dst, src))
    else:
        dst.copy_(src.dequantize(dst.dtype))
    return dst


# ---------------------------------------------------------------------------- gemms

# Which of a linear layer's three gemms a pair of operand roles is (keyed on the roles'
# values, which hash without a Python-level Enum.__hash__).
_GEMM_BY_ROLES = {(g.left.role.value, g.right.role.value): g.name for g in GEMMS}


def _mm(a: Float8TrainingTensor, b: Float8TrainingTensor) -> torch.Tensor:
    if not (isinstance(a, Float8TrainingTensor) and isinstance(b, Float8TrainingTensor)):
        raise NotImplementedError(
            "float8kit: mm of a float8 and an hp tensor; both operands of a float8 gemm must "
            "be float8 (check the CastConfig of both operands of that gemm)"
        )
    config = a._config or b._config or Float8LinearConfig()
    return gemm_plan(config, _GEMM_BY_ROLES.get((a._role._value_, b._role._value_)))(a, b)


@implements([aten.mm.default])
def _mm_op(func, args, kwargs):
    return _mm(args[0], args[1])


def mm(a: torch.Tensor, b: torch.Tensor, plan: GemmPlan | None = None) -> torch.Tensor:
    """``torch.mm(a, b)``; for two float8 operands in eager (``versions.eager_direct``) the
    table's mm called directly, without two dispatcher round trips into Python (``plan``:
    the layer's plan of this gemm, which the table's mm would make from the operands'
    config). Not under autocast, whose mm casts the operands first (a float8 operand's
    ``.to``: the hp dtype it stands for, which the gemm writes)."""
    if type(a) is Float8TrainingTensor and type(b) is Float8TrainingTensor:
        if versions.eager_direct() and not torch._C._is_any_autocast_enabled():
            return plan(a, b) if plan is not None else _mm(a, b)
    return torch.mm(a, b)


def t(a: torch.Tensor) -> torch.Tensor:
    """``a.t()`` of a 2-D tensor; a float8 one in eager directly, as ``mm``."""
    if type(a) is Float8TrainingTensor and versions.eager_direct():
        return _transposed(a, a._data.t(), 0, 1)
    return a.t()


@implements([aten.addmm.default])
def _addmm_op(func, args, kwargs):
    bias, a, b = args[0], args[1], args[2]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    out = _mm(a, b)
    if alpha != 1:
        out = out * alpha
    return out + (bias if beta == 1 else bias * beta).to(out.dtype)
