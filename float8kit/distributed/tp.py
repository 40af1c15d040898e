"""Float8 tensor and sequence parallel styles for ``parallelize_module``.

``Float8ColwiseParallel``, ``Float8RowwiseParallel`` and ``PrepareFloat8ModuleInput`` take the
arguments of torch's ``ColwiseParallel``, ``RowwiseParallel`` and ``PrepareModuleInput`` and
shard the same way, so a parallelize plan changes only its class names. What they add is the
sequence-parallel activation all-gather in float8: where an input arrives sharded
(``Shard(1)``: sequence parallel) and the layers need it whole (``Replicate()``), it is cast
to float8 *before* the all-gather, which then moves 1 byte per element instead of 2 (bf16):

- tensorwise: the scale comes from the whole activation's amax, one 4-byte all-reduce over
  the TP group, so every rank casts with the same scale and the gathered bytes are exactly
  the cast of the gathered hp activation;
- rowwise (axiswise): one scale per token, local; the per-token scales are gathered with
  the bytes (4 bytes per token, next to ``dim`` bytes of data).

The bytes travel as uint8 (gloo cannot carry float8 dtypes: "Invalid scalar type"). The
``Float8Linear`` layers that consume the gathered input use it as their float8 input (one
cast and one all-gather for wq/wk/wv, or w1/w3).

Backward. The input's gradient (partial sums on each rank) is reduce-scattered in hp, as
torch's styles do: a float8 reduce-scatter would add rounded partial sums. The other
sequence-parallel all-gather, of the gradient of a ``Float8RowwiseParallel`` output that
was reduce-scattered to ``Shard(1)``, moves float8 bytes too: cast with the layer's
grad_output cast (which that layer's gemms cast it with anyway), gathered, dequantized.

torch's own ``ColwiseParallel`` / ``RowwiseParallel`` also work on a converted model (every
recipe; ``float8kit.cast``): they gather activations in hp.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
)

from float8kit import formats, versions
from float8kit.cast import cast_to_float8
from float8kit.config import (
    CastConfig,
    Float8LinearConfig,
    GemmRole,
    ScalingType,
)
from float8kit.linear import Float8Linear
from float8kit.tensor import dequantize, is_float8

__all__ = ["Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput"]


def _gather_local(local: torch.Tensor, dim: int, mesh, logical_shape) -> torch.Tensor:
    """All-gather a ``Shard(dim)`` local tensor of a 1-D mesh to the whole tensor (uneven
    shards are padded and unpadded as DTensor does)."""
    if versions.PLACEMENT_METHODS_TRACE:
        return Shard(dim)._to_replicate_tensor(local, mesh, 0, logical_shape)
    # the same all-gather by hand: ranks hold chunks of ceil(n / world) rows along ``dim``
    # (the last ones shorter or empty), padded to that size, gathered, cut back to n
    n, world = logical_shape[dim], mesh.size(0)
    chunk = -(-n // world)
    pad = chunk - local.shape[dim]
    if pad:
        widths = [0, 0] * (local.dim() - 1 - dim) + [0, pad]
        local = torch.nn.functional.pad(local, widths)
    # gathered along dim 0 (along another dim funcol calls a helper dynamo skips)
    local = local.movedim(dim, 0).contiguous()
    out = funcol.all_gather_tensor(local, gather_dim=0, group=(mesh, 0))
    out = out.movedim(0, dim).contiguous()
    return out.narrow(dim, 0, n) if chunk * world != n else out


def _cast_and_gather(hp: DTensor, cast: CastConfig, role: GemmRole, config) -> DTensor:
    """hp DTensor ``Shard(d)`` -> float8 DTensor ``Replicate()``: cast the shards (one scale
    from the whole tensor's amax, or per-token scales along the last dim), all-gather the
    bytes as uint8, and the per-token scales when axiswise."""
    (shard,) = hp.placements
    dim = shard.dim % hp.dim()
    fp8 = cast_to_float8(hp, cast, role, -1, config)
    local = fp8._local_tensor
    mesh = hp.device_mesh
    data = _gather_local(local._data.view(torch.uint8), dim, mesh, hp.shape)
    scale = local._scale
    if local._axiswise_dim is not None:
        scale = _gather_local(scale.contiguous(), dim, mesh, (*hp.shape[:-1], 1))
    gathered = local.with_data(data.view(local._data.dtype), scale)
    return DTensor.from_local(gathered, mesh, [Replicate()], run_check=False)


class _Float8AllGather(torch.autograd.Function):
    """Forward: an hp input ``Shard(d)`` -> float8 ``Replicate()`` (``_cast_and_gather``
    with the input's cast). Backward: the hp gradient goes back to the input's layout (a
    reduce-scatter of partial sums)."""

    @staticmethod
    def forward(ctx, hp: DTensor, config: Float8LinearConfig) -> DTensor:
        ctx.placements = hp.placements
        return _cast_and_gather(hp, config.cast_config_input, GemmRole.INPUT, config)

    @staticmethod
    def backward(ctx, grad: DTensor):
        return grad.redistribute(placements=ctx.placements), None


class _ReduceScatterFloat8GradGather(torch.autograd.Function):
    """Forward: partial sums -> ``Shard(d)``, a reduce-scatter in hp (rounded partial sums
    would add up their errors). Backward: the ``Shard(d)`` gradient is all-gathered in float8
    with the layer's grad_output cast (``_cast_and_gather``) and handed on dequantized: the
    layer casts it again for its gemms (tensorwise: with the same scale)."""

    @staticmethod
    def forward(ctx, out: DTensor, placements, config: Float8LinearConfig) -> DTensor:
        ctx.config = config
        return out.redistribute(placements=placements)

    @staticmethod
    def backward(ctx, grad: DTensor):
        if not grad.placements[0].is_shard():  # a consumer made it whole: no all-gather left
            return grad.redistribute(placements=[Replicate()]), None, None
        c = ctx.config
        fp8 = _cast_and_gather(grad, c.cast_config_grad_output, GemmRole.GRAD_OUTPUT, c)
        return dequantize(fp8), None, None


def _float8_redistribute(
    x: DTensor, desired: tuple[Placement, ...], config: Float8LinearConfig, where: str
) -> DTensor:
    """``x.redistribute(desired)`` where a sequence-parallel all-gather moves float8 bytes."""
    if tuple(x.placements) == tuple(desired):
        return x
    (src,) = x.placements
    (dst,) = desired
    if not (src.is_shard() and dst.is_replicate()):
        raise NotImplementedError(
            f"float8kit: {where} redistributes its input from {src} to {dst}; the float8 styles "
            "only all-gather (Shard(d) -> Replicate()): use torch's styles for this layer"
        )
    if src.dim % x.dim() == x.dim() - 1:
        raise NotImplementedError(
            f"float8kit: {where} all-gathers its input along the last (feature) dim, which the "
            "float8 cast scales along; sequence parallel shards dim 1 (input_layouts=Shard(1))"
        )
    return _Float8AllGather.apply(x, config)


def _check_config(config: Float8LinearConfig, where: str, field: str = "cast_config_input"):
    """The cast before an all-gather takes its scale from the whole tensor itself: DYNAMIC,
    in a format whose DTensor cast takes the global amax (``formats.GLOBAL_AMAX``)."""
    cast = getattr(config, field)
    if cast.scaling_type is not ScalingType.DYNAMIC:
        raise ValueError(
            f"float8kit: {where} casts before the all-gather, which needs "
            f"Float8LinearConfig.{field} to be DYNAMIC (got {cast.scaling_type.value}): use "
            "torch's ColwiseParallel / RowwiseParallel / PrepareModuleInput (hp all-gather) here"
        )
    if formats.capabilities(cast).tensor_parallel != formats.GLOBAL_AMAX:
        fine = formats.supporting(lambda caps: caps.tensor_parallel == formats.GLOBAL_AMAX)
        raise ValueError(
            f"float8kit: {where} casts before the all-gather, which supports "
            f"{' and '.join(fine)} casts; Float8LinearConfig.{field} is "
            f"{cast.scaling_granularity.value}: use torch's ColwiseParallel / RowwiseParallel "
            "/ PrepareModuleInput (hp all-gather) here"
        )


def _check_layer(module: nn.Module, style: str) -> None:
    """A Float8Linear, every cast of it in a format that tensor parallelism supports (the
    allowlist: refused here, at parallelize time, not in a collective later)."""
    if not isinstance(module, Float8Linear):
        raise TypeError(
            f"Float8{style} needs a Float8Linear, got {type(module).__name__}: convert the "
            f"model with convert_to_float8_training first, or use torch's {style} for layers "
            "kept in hp"
        )
    formats.require(
        module.config,
        lambda caps: caps.tensor_parallel is not None,
        f"Float8{style} (tensor parallelism)",
        "keep this layer out of parallelize_module (or shard it with FSDP2 only), or use a "
        "recipe whose formats tensor parallelism supports",
    )


def _as_dtensor(x, mesh, layout: Placement) -> DTensor:
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (layout,), run_check=False)


class Float8ColwiseParallel(ColwiseParallel):
    """torch's ``ColwiseParallel`` for a ``Float8Linear``: same arguments and sharding; with
    ``input_layouts=Shard(1)`` (sequence parallel) the input is all-gathered in float8."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = _as_dtensor(inputs[0], device_mesh, input_layouts[0])
        if is_float8(x):  # already cast and gathered (PrepareFloat8ModuleInput)
            return x
        return _float8_redistribute(x, desired_input_layouts, mod.config, type(mod).__name__)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check_layer(module, "ColwiseParallel")
        if self.input_layouts != self.desired_input_layouts:
            _check_config(module.config, "Float8ColwiseParallel")
        return super()._apply(module, device_mesh)


class Float8RowwiseParallel(RowwiseParallel):
    """torch's ``RowwiseParallel`` for a ``Float8Linear``: same arguments and sharding. Its
    input is sharded on the feature dim (no all-gather); the output's partial sums are
    reduced (all-reduce, or reduce-scatter to ``Shard(1)``) in hp. With
    ``output_layouts=Shard(1)`` (sequence parallel) the backward all-gather of the output's
    gradient moves float8 bytes (the layer's grad_output cast); a feature-dim ``Shard(-1)``
    output keeps torch's hp all-gather."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        src, dst = tuple(outputs.placements), tuple(output_layouts)
        # Sharded on the sequence (not the feature dim, which rowwise gradient scales span)
        seq_shard = dst[0].is_shard() and dst[0].dim % outputs.dim() != outputs.dim() - 1
        if len(src) == 1 and src[0].is_partial() and seq_shard:
            outputs = _ReduceScatterFloat8GradGather.apply(outputs, dst, mod.config)
        elif src != dst:
            outputs = outputs.redistribute(placements=dst, async_op=True)
        return outputs.to_local() if use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check_layer(module, "RowwiseParallel")
        if self.output_layouts[0].is_shard():
            where = "Float8RowwiseParallel(output_layouts=Shard(d))"
            _check_config(module.config, where, "cast_config_grad_output")
        return super()._apply(module, device_mesh)


class PrepareFloat8ModuleInput(PrepareModuleInput):
    """torch's ``PrepareModuleInput`` that all-gathers ``Shard(d) -> Replicate()`` inputs in
    float8, for the ``Float8Linear`` layers inside the module (e.g. an attention's wq/wk/wv).

    Args:
        input_layouts, desired_input_layouts, input_kwarg_layouts,
        desired_input_kwarg_layouts, use_local_output: as torch's ``PrepareModuleInput``.
        fwd_config_submodule_fqn: the ``Float8Linear`` (fqn inside the module) whose
            ``cast_config_input`` casts the input. Default: the module itself if it is a
            ``Float8Linear``, else every ``Float8Linear`` inside it, which must agree.
    """

    def __init__(self, *args, fwd_config_submodule_fqn: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fwd_config_submodule_fqn = fwd_config_submodule_fqn
        self.config: Float8LinearConfig | None = None

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self.config = _input_config(module, self.fwd_config_submodule_fqn)
        _check_config(self.config, "PrepareFloat8ModuleInput")
        return super()._apply(module, device_mesh)

    def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):
        if (
            input_layout is None
            or desired_layout is None
            or input_layout == desired_layout
            or not isinstance(input, torch.Tensor)
            or not input.is_floating_point()
        ):
            return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)
        x = _as_dtensor(input, mesh, input_layout)
        x = _float8_redistribute(x, (desired_layout,), self.config, "PrepareFloat8ModuleInput")
        return x.to_local() if self.use_local_output else x


def _input_config(module: nn.Module, fqn: str | None) -> Float8LinearConfig:
    """The config whose input cast ``PrepareFloat8ModuleInput`` uses (see its docstring)."""
    if fqn is not None:
        sub = module.get_submodule(fqn)
        if not isinstance(sub, Float8Linear):
            raise ValueError(
                f"PrepareFloat8ModuleInput(fwd_config_submodule_fqn={fqn!r}) names a "
                f"{type(sub).__name__}, not a Float8Linear"
            )
        return sub.config
    linears = [m for m in module.modules() if isinstance(m, Float8Linear)]
    if not linears:
        raise ValueError(
            f"PrepareFloat8ModuleInput: {type(module).__name__} holds no Float8Linear to use "
            "the float8 input: use torch's PrepareModuleInput (hp all-gather)"
        )
    first = linears[0].config
    key = (first.cast_config_input, first.round_scales_to_power_of_2)
    if any(
        (m.config.cast_config_input, m.config.round_scales_to_power_of_2) != key for m in linears
    ):
        raise ValueError(
            f"PrepareFloat8ModuleInput: the Float8Linear layers in {type(module).__name__} cast "
            "their input differently; pass fwd_config_submodule_fqn= to pick the layer whose "
            "cast_config_input applies"
        )
    return first
