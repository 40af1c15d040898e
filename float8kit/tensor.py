"""The float8 training tensor: fp8 data + scale, standing in for an hp tensor.

Internal: users meet it only as the weight FSDP2 all-gathers in float8, or by debugging.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from float8kit import versions
from float8kit.config import Float8LinearConfig, GemmRole
from float8kit.formats import TENSORWISE, Format

# aten op overload -> ``fn(func, args, kwargs)``: filled by float8kit/ops.py's ``@implements``
# (imported by ``float8kit/__init__``), so that this module imports nothing above it. An op
# not in it raises: nothing silently falls back to hp math.
OP_TABLE: dict = {}


class Float8TrainingTensor(torch.Tensor):
    """A float8 tensor that reports itself as its hp dtype.

    Invariants:
        - ``_data`` is a float8 tensor of ``self.shape``; ``self.dtype`` is ``_orig_dtype``
          (the hp dtype it stands for), so autograd and FSDP2 see an hp tensor.
        - ``_scale`` is fp32 and multiplies: ``_data ~ saturate(hp * _scale)``, laid out as
          ``_gran`` says (float8kit.formats: tensorwise shape ``()``, axiswise the data's
          shape with the scaled-along dim reduced to 1, blockwise one scale per block); MX
          blocks (``formats.MX``) carry e8m0 exponent bytes (uint8) instead, which divide.
        - ``_role`` says which linear operand it is; ``_config`` carries the gemm settings
          (fast accumulation, emulate, padding) that ``mm`` on it uses (None = defaults).
        - Every aten op on it goes through ``OP_TABLE`` (float8kit/ops.py); an op not in it
          raises.
    """

    _data: torch.Tensor
    _scale: torch.Tensor
    _orig_dtype: torch.dtype
    _role: GemmRole
    _gran: Format
    _config: Float8LinearConfig | None

    __slots__ = ["_data", "_scale", "_orig_dtype", "_role", "_gran", "_config"]

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        scale: torch.Tensor,
        orig_dtype: torch.dtype,
        role: GemmRole,
        gran: Format = TENSORWISE,
        config: Float8LinearConfig | None = None,
    ):
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=orig_dtype,
            layout=data.layout,
            device=data.device,
            requires_grad=False,
        )
        self._data, self._scale, self._orig_dtype = data, scale, orig_dtype
        self._role, self._gran, self._config = role, gran, config
        return self

    # what the gemm routes on (float8kit/gemm.py): derived from the granularity
    @property
    def _axiswise_dim(self) -> int | None:
        return self._gran.axiswise_dim

    @property
    def _block(self) -> tuple[int, int] | None:
        return self._gran.block

    def __repr__(self):
        return (
            f"Float8TrainingTensor(role={self._role.value}, fp8={self._data.dtype}, "
            f"hp={self._orig_dtype}, {self._gran.short()}, shape={tuple(self.shape)})"
        )

    def __tensor_flatten__(self):
        return ["_data", "_scale"], (self._orig_dtype, self._role, self._gran, self._config)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return Float8TrainingTensor(inner_tensors["_data"], inner_tensors["_scale"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        fn = OP_TABLE.get(func)
        if fn is None:
            raise NotImplementedError(
                f"float8kit: {func} is not implemented for Float8TrainingTensor; call "
                ".dequantize() first if hp math is really meant, or register it in "
                "float8kit/ops.py"
            )
        return fn(func, args, kwargs or {})

    # No torch_function override: ops reach __torch_dispatch__ after autograd.
    __torch_function__ = torch._C._disabled_torch_function_impl

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The hp tensor this stands for: ``_data / _scale`` (MX: ``_data * 2 ** (e - 127)``)
        in ``dtype`` (default: hp)."""
        return self._gran.dequantize(self._data, self._scale).to(dtype or self._orig_dtype)

    def with_data(
        self,
        data: torch.Tensor,
        scale: torch.Tensor | None = None,
        gran: Format | None = None,
        orig_dtype: torch.dtype | None = None,
    ):
        """A copy of this tensor's metadata around new ``data`` (and ``scale``, ``gran``)."""
        return Float8TrainingTensor(
            data,
            self._scale if scale is None else scale,
            orig_dtype or self._orig_dtype,
            self._role,
            gran or self._gran,
            self._config,
        )


# ---------------------------------------------------------------------------- in DTensors
#
# Under tensor parallelism a cast of a DTensor is a DTensor whose local tensor is a
# Float8TrainingTensor (the layout torchao uses too): the DTensor keeps the sharding, the
# float8 tensor the bytes and the scale. The scale is a plain local tensor, never a DTensor,
# so the gemm only ever sees local operands.


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


def wrap_local(local: torch.Tensor, like: DTensor, shape: tuple | None = None) -> DTensor:
    """``local`` as the local tensor of a DTensor with ``like``'s mesh and placements, and
    ``like``'s shape or the global ``shape`` given (row-major)."""
    stride = _stride(like) if shape is None else torch.empty(shape, device="meta").stride()
    shape = like.shape if shape is None else shape
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=shape, stride=stride
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
    if versions.compiling():
        stride, n = [], 1
        for size in reversed(t.shape):
            stride.append(n)
            n *= max(size, 1)
        return tuple(reversed(stride))
    return t.stride()
