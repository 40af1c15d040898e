"""The float8 training tensor: fp8 data + scale, standing in for an hp tensor.

Internal: users meet it only as the weight FSDP2 all-gathers in float8, or by debugging.
"""

from __future__ import annotations

import torch

from float8kit.config import Float8LinearConfig, GemmRole
from float8kit.scaling import expand_block_scale, to_fp8_blocks, to_fp8_saturated


class Float8TrainingTensor(torch.Tensor):
    """A float8 tensor that reports itself as its hp dtype.

    Invariants:
        - ``_data`` is a float8 tensor of ``self.shape``; ``self.dtype`` is ``_orig_dtype``
          (the hp dtype it stands for), so autograd and FSDP2 see an hp tensor.
        - ``_scale`` is fp32 and multiplies: ``_data ~ saturate(hp * _scale)``. Tensorwise:
          shape ``()``. Axiswise: ``_data``'s shape with ``_axiswise_dim`` reduced to 1 (one
          scale per slice along the gemm's inner dim). Blockwise: 2-D ``_data`` and one scale
          per ``_block`` = (rows, cols) block, shape (ceil(R / rows), ceil(C / cols)).
        - ``_axiswise_dim`` is None (tensorwise, blockwise) or a non-negative dim index.
        - ``_block`` is None (tensorwise, axiswise) or the (rows, cols) of a scale block:
          (1, 128) / (128, 1) tiles of an activation, (128, 128) blocks of a weight.
        - ``_role`` says which linear operand it is; ``_config`` carries the gemm settings
          (fast accumulation, emulate, padding) that ``mm`` on it uses (None = defaults).
        - Every aten op on it goes through ``ops.py``'s table; an op not in it raises.
    """

    _data: torch.Tensor
    _scale: torch.Tensor
    _orig_dtype: torch.dtype
    _role: GemmRole
    _axiswise_dim: int | None
    _config: Float8LinearConfig | None
    _block: tuple[int, int] | None

    __slots__ = ["_data", "_scale", "_orig_dtype", "_role", "_axiswise_dim", "_config", "_block"]

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        scale: torch.Tensor,
        orig_dtype: torch.dtype,
        role: GemmRole,
        axiswise_dim: int | None = None,
        config: Float8LinearConfig | None = None,
        block: tuple[int, int] | None = None,
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
        self._data = data
        self._scale = scale
        self._orig_dtype = orig_dtype
        self._role = role
        self._axiswise_dim = axiswise_dim
        self._config = config
        self._block = None if block is None else tuple(block)
        return self

    def __repr__(self):
        gran = "tensorwise" if self._axiswise_dim is None else f"axiswise(dim={self._axiswise_dim})"
        if self._block is not None:
            gran = f"blockwise({self._block[0]}x{self._block[1]})"
        return (
            f"Float8TrainingTensor(role={self._role.value}, fp8={self._data.dtype}, "
            f"hp={self._orig_dtype}, {gran}, shape={tuple(self.shape)})"
        )

    def __tensor_flatten__(self):
        ctx = (self._orig_dtype, self._role, self._axiswise_dim, self._config, self._block)
        return ["_data", "_scale"], ctx

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        orig_dtype, role, axiswise_dim, config, block = ctx
        return Float8TrainingTensor(
            inner_tensors["_data"],
            inner_tensors["_scale"],
            orig_dtype,
            role,
            axiswise_dim,
            config,
            block,
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from float8kit.ops import dispatch

        return dispatch(func, args, kwargs or {})

    # No torch_function override: ops reach __torch_dispatch__ after autograd.
    __torch_function__ = torch._C._disabled_torch_function_impl

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The hp tensor this stands for: ``_data / _scale`` in ``dtype`` (default: hp)."""
        scale = self._scale
        if self._block is not None:
            scale = expand_block_scale(scale, self._block, self._data.shape)
        return (self._data.to(torch.float32) / scale).to(dtype or self._orig_dtype)

    def with_data(self, data: torch.Tensor, scale: torch.Tensor | None = None, **changes):
        """A copy of this tensor's metadata around new ``data`` (and ``scale``)."""
        return Float8TrainingTensor(
            data,
            self._scale if scale is None else scale,
            changes.get("orig_dtype", self._orig_dtype),
            self._role,
            changes.get("axiswise_dim", self._axiswise_dim),
            self._config,
            changes.get("block", self._block),
        )


def hp_to_float8(
    hp: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    role: GemmRole,
    axiswise_dim: int | None = None,
    config: Float8LinearConfig | None = None,
    *,
    guard_non_finite: bool = True,
    block: tuple[int, int] | None = None,
) -> Float8TrainingTensor:
    """Cast ``hp`` with a given ``scale`` (fp8 = saturate(hp * scale)) and wrap it: one
    scale per ``block`` of a 2-D ``hp`` when given (see ``scaling.block_amax``).
    ``guard_non_finite``: see ``scaling.to_fp8_saturated``."""
    if block is not None:
        data = to_fp8_blocks(hp, scale, block, fp8_dtype, guard_non_finite=guard_non_finite)
        return Float8TrainingTensor(data, scale, hp.dtype, role, None, config, block)
    data = to_fp8_saturated(hp, scale, fp8_dtype, guard_non_finite=guard_non_finite)
    if axiswise_dim is not None and axiswise_dim < 0:
        axiswise_dim += hp.dim()
    return Float8TrainingTensor(data, scale, hp.dtype, role, axiswise_dim, config)
