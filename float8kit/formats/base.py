"""What every format answers, and the base that answers nothing.

A format is the layout of a quantized tensor: its elements (float8 or e2m1), its scales
(how many, their shape per element, the rule that makes them) and what follows from them.
``Format`` lists the questions; each format module answers them for one format, and the base
raises for every one, so that a format never inherits another's behaviour by accident.

Shard layout (the FSDP2 float8 all-gather, float8kit.distributed.fsdp). A weight's *scaling
groups* are the slices that share one scale. FSDP2 shards the weight along one dim (dim 0 by
default, unevenly, with empty shards on some ranks); a rank sees only its part of each group.
Every group's amax over the full weight is the MAX over ranks of the group's amax over each
rank's part, where a rank that does not touch a group contributes 0 (amaxes are never
negative): one all-reduce(MAX) of same-shape tensors on every rank (the hook's fallback, or a
slice of ``precompute_scales``' single collective). ``group_amaxes`` fills the full weight's
scale shape from a shard, ``shard_scale`` is the part of the full scale that casts the shard,
``gathered_scale`` the part the gathered weight needs; ``ShardSpec`` says where the shard sits
(under tensor parallelism the full shape is the global weight's). Internal.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from float8kit import scaling
from float8kit.config import E4M3, GemmRole, ScalingType

# what a format's ``dtensor_cast`` capability says a tensor-parallel (DTensor) operand needs:
# the amax of the whole tensor (one small all-reduce over the mesh), or nothing beyond the
# local shard (every block's scale is its own)
GLOBAL_AMAX, LOCAL_BLOCKS = "global_amax", "local_blocks"


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a format supports, as data: every entry point (conversion, ``parallelize_module``
    styles, FSDP2, MoE experts, expert parallelism) asks these and refuses at once, naming
    the config field, instead of failing later in a kernel or a collective."""

    # the scaling policies its scale can come from (CastConfig.scaling_type; DISABLED aside)
    scaling_types: tuple[ScalingType, ...]
    # FSDP2 float8 all-gather of a linear layer's weight (enable_fsdp_float8_all_gather)
    fsdp_float8_all_gather: bool
    # tensor parallelism (Float8ColwiseParallel / Float8RowwiseParallel / sequence parallel):
    # GLOBAL_AMAX, LOCAL_BLOCKS (see above), or None: not supported
    tensor_parallel: str | None
    # MoE expert weights' grouped gemms (Float8ExpertsConfig.cast_config)
    experts: bool
    # expert-parallel dispatch of tokens already cast (float8kit.distributed.expert_parallel)
    ep_dispatch: bool
    # both dims of a converted linear layer must be multiples of this (None: any size; the
    # CUDA gemm's alignment of 16 is then checked at the gemm, or padded by pad_inner_dim)
    layer_multiple: int | None
    # the oldest CUDA compute capability whose kernels run it
    min_cuda_capability: tuple[int, int]
    # the gemm family it runs in (float8kit.gemm's table): operands of one gemm must share it
    gemm: str


class Format:
    """The layout of a quantized tensor (see the module docstring). Frozen and hashable in
    every subclass: compiled graphs guard on it."""

    # the format's capabilities (a class attribute of every format)
    capabilities: ClassVar[Capabilities]
    # for the gemm's kernel choice: the dim axiswise scales run along, the block of a
    # block-scaled operand (None where it does not apply)
    axiswise_dim: int | None = None
    block: tuple[int, int] | None = None
    # the dim an MX operand's 32-element blocks run along (None: not MX)
    mx_dim: int | None = None
    # the (rows, cols) of an NVFP4 operand's scale block (None: not NVFP4)
    nvfp4_block: tuple[int, int] | None = None
    # FSDP2 may shard a float8 all-gather weight along any dim (False: dim 0 only)
    shards_any_dim: ClassVar[bool] = False
    # an FSDP2 float8 all-gather weight is one copy per pass, blocked along that pass's gemm's
    # inner dim (the blocks are not their own transpose, and a re-cast from the other copy's
    # dequantized values would not be the cast of the hp weight): a gemm holding another
    # pass's copy has its own gathered (float8kit.distributed.fsdp.regather)
    copy_per_pass: ClassVar[bool] = False

    @classmethod
    def for_operand(cls, cast, role, reduce_dim: int, ndim: int) -> Format:
        """The object an ``ndim``-D operand of ``role`` cast per ``cast`` (a CastConfig) is
        cast in, for a gemm that reduces its dim ``reduce_dim``."""
        raise NotImplementedError(f"float8kit: the format {cls.__name__} makes no operands")

    @classmethod
    def filter_multiple(cls, cast) -> int:
        """What both dims of a layer cast per ``cast`` should be multiples of for the default
        module filter to convert it: the CUDA gemm's 16, or the format's own need."""
        return math.lcm(16, cls.capabilities.layer_multiple or 16)

    def _missing(self, what: str):
        raise NotImplementedError(f"float8kit: the format {type(self).__name__} has no {what}")

    def short(self) -> str:
        return self._missing("short name")

    # ------------------------------------------------------------------ quantize

    def quantize(
        self, hp: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, guard: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, scale)`` of ``hp`` cast with a given ``scale`` (fp8 = saturate(hp *
        scale) in this layout); ``guard``: keep inf/NaN visible after the clamp (a scale
        not from ``hp``'s own amax needs it, see ``to_fp8_saturated``)."""
        return self._missing("quantize")

    def quantize_dynamic(
        self, hp: torch.Tensor, fp8_dtype: torch.dtype, cast, round_to_pow2: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, scale)`` of ``hp`` with the scale this format makes from ``hp`` itself
        (its scale rule; ``cast`` is the operand's CastConfig)."""
        return self._missing("dynamic quantize")

    def amax(self, hp: torch.Tensor) -> torch.Tensor:
        """The amax of each scaling group of ``hp``, in the scale's shape (float8kit.scaling)."""
        return self._missing("amax")

    def dtensor_amax(self, hp) -> torch.Tensor:
        """The amax of each scaling group of a tensor-parallel DTensor ``hp`` as a plain
        local tensor in the local scale's shape (the formats whose TP cast takes the global
        amax, ``GLOBAL_AMAX``)."""
        return self._missing("DTensor amax")

    def expand(self, scale: torch.Tensor, shape) -> torch.Tensor:
        """``scale`` broadcastable to one scale per element of data of ``shape``."""
        return self._missing("scale expansion")

    def dequantize(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The fp32 values ``data`` with ``scale`` stands for."""
        return self._missing("dequantize")

    def multiplier(self, scale: torch.Tensor, shape) -> torch.Tensor:
        """The fp32 factor per element that took hp to its elements (``fp8 ~ hp * factor``)."""
        return self._missing("multiplier")

    def cast_input(self, hp: torch.Tensor) -> torch.Tensor:
        """What the cast multiplied by ``multiplier`` and rounded (``hp``, or a transform)."""
        return self._missing("cast input")

    def elements(self, data: torch.Tensor) -> torch.Tensor:
        """The fp32 values of the elements ``data`` holds (before the scale)."""
        return self._missing("element decoding")

    def element_max(self, data: torch.Tensor) -> float:
        """The largest finite element value of ``data``'s format."""
        return self._missing("element max")

    def scale_bytes(self, scale: torch.Tensor, wire: str) -> torch.Tensor:
        """Rows' (R, s) scale as uint8 (R, b) bytes on the wire (expert parallelism's
        dispatch): ``wire`` "fp32" (exact) or "e8m0" (the exponent byte: exact for powers
        of two), where the format's scale is not bytes already."""
        return self._missing("scale bytes")

    def scale_from_bytes(self, data: torch.Tensor, wire: str) -> torch.Tensor:
        """The scale ``scale_bytes`` put on the wire."""
        return self._missing("scale bytes")

    # ------------------------------------------------------------------ layout ops

    def transpose(self, scale: torch.Tensor, d0: int, d1: int):
        """(format, scale) of the data transposed along ``d0``, ``d1`` (non-negative)."""
        return self._missing("transpose")

    def view(self, scale: torch.Tensor, old, new, func):
        """(format, scale) of the data viewed from shape ``old`` to ``new``."""
        return self._missing("view")

    def strided(self, scale: torch.Tensor, rows: int | None, ndim: int) -> torch.Tensor | None:
        """The scale of an ``as_strided`` view: ``rows`` = the view is the first ``rows`` whole
        rows of 2-D data (FSDP2's view of an unsharded weight in its padded all-gather
        buffer), None = any other view. None when this layout cannot take the view."""
        return self._missing("as_strided")

    def sliced(self, scale: torch.Tensor, dim: int, fn, func) -> torch.Tensor:
        """The scale of the data sliced along ``dim`` by ``fn`` (applied to the scale where it
        varies along ``dim``)."""
        return self._missing("slicing")

    def split(self, scale: torch.Tensor, dim: int, n: int, fn, func) -> list[torch.Tensor]:
        """The scales of ``n`` pieces of the data split along ``dim``."""
        return self._missing("split")

    def cat(self, scales: list[torch.Tensor], dim: int, fn, func) -> torch.Tensor:
        """The scale of data concatenated along ``dim`` (raises if the scales cannot merge)."""
        return self._missing("cat")

    # ------------------------------------------------------------------ shard layout

    def group_amaxes(self, shard: torch.Tensor, where: ShardSpec) -> torch.Tensor:
        """fp32 amaxes of the full weight's groups over ``shard``'s part of them (0 for the
        groups it does not touch), in the full scale's shape; NaN becomes inf."""
        return self._missing("shard amaxes")

    def shard_scale(self, scale: torch.Tensor, shard: torch.Tensor, where: ShardSpec):
        """The part of the full weight's ``scale`` that casts ``shard`` (broadcasts to it)."""
        return self._missing("shard scale")

    def gathered_scale(self, scale: torch.Tensor, where: ShardSpec) -> torch.Tensor:
        """The part of the full weight's ``scale`` that the gathered (outer) weight needs."""
        return self._missing("gathered scale")

    def cuts(self, outer_rows: int, world: int) -> bool:
        """Whether FSDP2's dim-0 shards of ``outer_rows`` rows over ``world`` ranks cut a
        scaling group whose scale is local to the rows (a block)."""
        return self._missing("shard cut rule")

    # ------------------------------------------------------------------ FSDP2 all-gather
    # float8kit.distributed.fsdp runs one lifecycle for every format: the hooks, the re-gather
    # of a pass that has none of its own, the precomputed scale, refilling FSDP2's ``out``.
    # A format supplies what a pass gathers, given the lifecycle's ``job`` (fsdp.AllGather:
    # the shard, where it sits, its layer's scale and the collectives over its ranks).

    def all_gather_inputs(self, job) -> tuple[tuple[torch.Tensor, ...], tuple]:
        """``fsdp_pre_all_gather``'s return for ``job.shard``: the all-gather inputs (each
        with FSDP2's padded shard size) and the metadata ``all_gathered`` reads."""
        return self._missing("FSDP2 float8 all-gather")

    def all_gathered(self, outputs: tuple[torch.Tensor, ...], metadata: tuple, config):
        """``(data, scale, format, tensors FSDP2 frees)`` of the gathered weight, from the
        inputs of every rank in order (``outputs``) and ``all_gather_inputs``' metadata."""
        return self._missing("FSDP2 float8 all-gather")

    def refill(self, weight, outputs: tuple[torch.Tensor, ...], metadata: tuple) -> None:
        """A re-gather: make ``weight`` (the float8 tensor the first all-gather built, whose
        data views FSDP2's refilled buffers) this all-gather's weight, in place."""
        return self._missing("FSDP2 float8 all-gather")

    def precomputes(self, where: ShardSpec, world: int) -> bool:
        """Whether ``precompute_scales`` makes this weight's next all-gather scale (its amaxes
        join the one all-reduce); False: the hook makes every scale, or each is local."""
        return self._missing("precomputed all-gather scale")

    def precompute_amaxes(self, shards: list, wheres: list) -> tuple[list, list]:
        """For weights of this format and cast: ``(pieces, shapes)``, their shards' amaxes as
        1-D pieces (concatenated, in order, they are each weight's amaxes flattened) and each
        weight's amax shape. The all-reduce(MAX) over the ranks makes them the full weight's."""
        return self._missing("precomputed all-gather scale")

    def precomputed_scales(self, reduced: torch.Tensor, shapes: list, cast, config) -> list:
        """Each weight's next all-gather scale from its reduced amaxes (``reduced``: theirs,
        flattened and concatenated in order; ``shapes``: ``precompute_amaxes``')."""
        return self._missing("precomputed all-gather scale")


class Float8Elements:
    """A format of float8 elements (tensorwise, axiswise, blockwise, MX): the elements are
    the data's own values, bounded by its dtype's max. By default the scale *multiplies*
    (``fp8 = saturate(hp * scale)``), is broadcast by ``expand`` and is made from the amax of
    each scaling group (``amax``); MX overrides these (its e8m0 scale divides)."""

    def quantize(self, hp, scale, fp8_dtype, guard):
        return to_fp8_saturated(hp, scale, fp8_dtype, guard_non_finite=guard), scale

    def quantize_dynamic(self, hp, fp8_dtype, cast, round_to_pow2):
        scale = scaling.amax_to_scale(self.amax(hp), fp8_dtype, round_to_pow2)
        # a dynamic scale already turns inf/NaN into NaN (scale 0 or NaN): no guard pass
        return self.quantize(hp, scale, fp8_dtype, False)

    def expand(self, scale, shape):
        return scale

    def dequantize(self, data, scale):
        return data.to(torch.float32) / self.expand(scale, data.shape)

    def multiplier(self, scale, shape):
        return self.expand(scale, shape)

    def cast_input(self, hp):
        return hp

    def elements(self, data):
        return data.to(torch.float32)

    def element_max(self, data):
        return scaling.fp8_max(data.dtype)


# FSDP2 float8 all-gather of weights whose data is the float8 cast of the hp shard with a
# scale from the full weight's group amaxes (tensorwise, rowwise, blockwise where shards cut
# blocks): the scale is the layer's policy's (``job.policy_scale``: precomputed, or from one
# all-reduce; delayed and static from the layer's buffers), each shard is cast with its part
# of it, and the gathered weight carries the part the outer weight needs.


class GroupScaledGather:
    """The FSDP2 all-gather rule of a ``Float8Elements`` format whose scaling groups span
    shards (see the comment above); ``_gathered_rows`` says which rows of the padded gathered
    buffer the weight keeps."""

    def all_gather_inputs(self, job):
        scale = job.policy_scale()
        shard = job.shard
        data = to_fp8_saturated(shard, self.shard_scale(scale, shard, job.where), job.fp8_dtype)
        # Raw bytes: gloo cannot gather float8 dtypes ("Invalid scalar type"), and a uniform
        # uint8 input lets FSDP2 gather fp8 weights and hp biases in one uint8 buffer.
        data = job.pad(data.view(torch.uint8))
        return (data,), (self.gathered_scale(scale, job.where), *self._rows_metadata(job))

    def _rows_metadata(self, job) -> tuple:
        return ()

    def all_gathered(self, outputs, metadata, config):
        (data,), (scale, *rows) = outputs, metadata
        fp8 = data.view(config.cast_config_weight.dtype_for(GemmRole.WEIGHT))
        # clone: the scale may be the precomputed one, which must not alias the weight's
        return self._gathered_rows(fp8, scale, *rows), scale.clone(), self, (data,)

    def _gathered_rows(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # the padded buffer itself: FSDP2's as_strided to the full size takes its rows
        return data

    def refill(self, weight, outputs, metadata):
        refill_scale(weight, metadata[0])

    def precomputes(self, where, world):
        return True

    def precompute_amaxes(self, shards, wheres):
        amaxes = [self.group_amaxes(s, w) for s, w in zip(shards, wheres, strict=True)]
        return [a.reshape(-1) for a in amaxes], [a.shape for a in amaxes]

    def precomputed_scales(self, reduced, shapes, cast, config):
        # the DYNAMIC weight scale of the layer's policy (cast.operand_scale), elementwise
        scale = scaling.amax_to_scale(
            reduced, cast.dtype_for(GemmRole.WEIGHT), config.round_scales_to_power_of_2
        )
        return split_flat(scale, shapes)


def split_flat(flat: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    """``flat`` (precomputed values laid end to end) cut back into tensors of ``shapes``."""
    pieces = flat.split([math.prod(s) for s in shapes])
    return [p.reshape(shape) for p, shape in zip(pieces, shapes, strict=True)]


def refill_scale(weight, scale: torch.Tensor) -> None:
    """A re-gather (FSDP2's ``out``): copy the new scale into ``weight``, the float8 tensor
    the first all-gather built, whose data already views the refilled all-gather buffer.

    In place, without a version bump, the way FSDP2 refills the data bytes. Autograd may
    have saved this scale in the forward (compiled graphs with activation checkpointing save
    graph inputs, not derived tensors), and the backward re-gather must not invalidate it.
    Sound for the same reason as FSDP2's data refill: between a forward and its backward the
    weight does not change, so every re-gather writes back the value that was saved."""
    with torch.autograd._unsafe_preserve_version_counter(weight._scale):
        weight._scale.copy_(scale)


def local_scale_inputs(
    data: torch.Tensor, scale: torch.Tensor, padded_rows: int, rows_per_scale: int, world: int
):
    """``fsdp_pre_all_gather``'s return for a float8 shard whose scales are its own (a dense
    weight's whole blocks, an expert weight's per-expert scales): the fp8 bytes and the fp32
    scales' bytes as two uint8 all-gather inputs, both padded along dim 0 to FSDP2's padded
    shard size (``padded_rows`` data rows; a padding scale is 1.0). On one rank FSDP2 copies
    only the first all-gather input, so the scales go as metadata there instead."""
    data = data.view(torch.uint8)
    if padded_rows != data.shape[0]:  # uneven: the last ranks' shards are padded
        pad = padded_rows - data.shape[0]
        data = torch.nn.functional.pad(data, (0, 0) * (data.dim() - 1) + (0, pad))
        pad = padded_rows // rows_per_scale - scale.shape[0]
        scale = torch.nn.functional.pad(scale, (0, 0) * (scale.dim() - 1) + (0, pad), value=1.0)
    if world == 1:
        return (data,), (scale,)
    return (data, scale.contiguous().view(torch.uint8)), ()


def local_scale_outputs(all_gather_outputs, metadata, fp8_dtype: torch.dtype, out):
    """``(data, scale, tensors to free)`` from what ``local_scale_inputs`` sent, for the post
    hook to wrap; None on a re-gather (``out``), where the weight's data and scales view the
    buffers FSDP2 refilled (on one rank, the scales from metadata are copied in place)."""
    if len(all_gather_outputs) == 1:  # one rank: the scales came as metadata
        (data,), (scale,) = all_gather_outputs, metadata
        if out is not None:
            refill_scale(out, scale)
            return None
        return data.view(fp8_dtype), scale.clone(), (data,)
    if out is not None:
        return None
    data, scale_bytes = all_gather_outputs
    data, scale = data.view(fp8_dtype), scale_bytes.view(torch.float32)
    return data, scale, (data, scale)


class AlongDim:
    """Scales that run along one dim (``dim``): an operand is cast along the dim its gemm
    reduces, and a transpose moves that dim with the data."""

    @classmethod
    def for_operand(cls, cast, role, reduce_dim, ndim):
        return cls(reduce_dim % ndim)

    def transpose(self, scale, d0, d1):
        dim = {d0: d1, d1: d0}.get(self.dim, self.dim)
        return type(self)(dim), scale.transpose(d0, d1)


class WholeBlocks:
    """Layout ops on data in ``rows`` x ``cols`` blocks, scales in a grid of them (the last
    two dims of the scale): a transpose transposes both; slicing, splitting, concatenating
    and reshaping blocks of more than one row would cut through them: refused (``_named``
    names the format)."""

    _named: ClassVar[str]

    def sliced(self, scale, dim, fn, func):
        self._refuse(func)

    def split(self, scale, dim, n, fn, func):
        self._refuse(func)

    def cat(self, scales, dim, fn, func):
        self._refuse(func)

    def view(self, scale, old, new, func):
        if tuple(new) != tuple(old):
            self._refuse(func, old)
        return self, scale

    def transpose(self, scale, d0, d1):
        # the scale grid (its last two dims) and the block shape transpose with the data
        if d0 == d1:
            return self, scale
        return dataclasses.replace(self, rows=self.cols, cols=self.rows), scale.transpose(-2, -1)

    def strided(self, scale, rows, ndim):
        # FSDP2's view of the gathered weight: its first rows, the first rows of the grid
        return None if rows is None else scale[..., : -(-rows // self.rows), :]

    def _refuse(self, func, shape=None):
        of = f" {tuple(shape)}" if shape is not None else ""
        raise NotImplementedError(
            f"float8kit: {func} on {self._named} Float8TrainingTensor{of} (blocks "
            f"{self.rows}x{self.cols}) would cut through its scale blocks; call "
            ".dequantize() first if hp math is really meant"
        )


def same_scales(scales: list[torch.Tensor]) -> torch.Tensor:
    """The one scale of pieces concatenated along a dim their scales do not vary along."""
    for s in scales[1:]:
        if not torch.equal(s, scales[0]):
            raise ValueError("float8kit: cat of float8 tensors with different scales")
    return scales[0]


# ---------------------------------------------------------------------------- saturation


def to_fp8_saturated(
    hp: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *, guard_non_finite: bool = True
) -> torch.Tensor:
    """``saturate(hp * scale)`` as ``fp8_dtype``: finite values clamp to +-fp8_max, inf/NaN stay
    non-finite (NaN in e4m3fn, which has no inf; inf/NaN kept in e5m2).

    ``guard_non_finite=False`` skips the elementwise pass that restores non-finite values
    after the clamp. That is safe exactly when ``scale`` came from this tensor's own amax
    (DYNAMIC): an inf makes the amax inf and the scale 0 (``inf * 0 = NaN``), a NaN makes the
    scale NaN, and the clamp keeps NaN. A scale from elsewhere (delayed, static, precomputed)
    needs the guard, or an inf would saturate to +-fp8_max.
    """
    scaled = hp.to(torch.float32) * scale
    limit = scaling.fp8_max(fp8_dtype)
    clamped = torch.clamp(scaled, min=-limit, max=limit)
    if not guard_non_finite:
        return clamped.to(fp8_dtype)
    # Adding (scaled - scaled) is 0 for finite values and NaN for inf/NaN: one fused
    # elementwise op that puts non-finite values back after the clamp.
    if fp8_dtype == E4M3:
        return (clamped + (scaled - scaled)).to(fp8_dtype)
    return torch.where(torch.isfinite(scaled), clamped, scaled).to(fp8_dtype)


# ---------------------------------------------------------------------------- shards


def check_one_dim_mesh(job, what: str) -> None:
    """Refuse a float8 all-gather weight sharded on a multi-dim mesh (tensor parallel, HSDP)
    where the format's gather rule assumes FSDP2's 1-D mesh holds all of it."""
    if job.where.n_slots != 1 or tuple(job.where.full_shape) != tuple(job.outer_size):
        raise ValueError(
            f"float8kit: an {what} float8 all-gather weight on a multi-dim mesh (tensor "
            "parallel, HSDP) is not supported: shard it with FSDP2 on a 1-D mesh, or set "
            "enable_fsdp_float8_all_gather=False"
        )


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """Where a rank's shard sits in the FSDP2-unsharded weight and in the global one.

    FSDP2 shards the *outer* weight (``outer_shape``: the weight itself on a 1-D mesh or
    HSDP, this rank's tensor-parallel shard of it on a 2-D (dp, tp) mesh) along ``dim`` (None
    when the shard is the whole outer weight: one rank, or a dim FSDP2 did not need to split),
    from ``offset`` on. FSDP2 shards like ``torch.chunk``: every shard but the last non-empty
    ones has ``ceil(size / world)`` slices, so rank r starts at ``r * ceil(size / world)``.

    ``outer_offset`` is the outer weight's first index along each dim of the global weight
    (``full_shape``; all 0 without tensor parallelism). ``slot`` numbers this rank's place
    on the mesh dims other than FSDP2's shard dim (``n_slots`` of them: the TP shard, the
    HSDP replica): groups that live in the outer weight's own coordinates (blockwise
    blocks) reduce over ranks of the same slot only, see ``Blockwise``.
    """

    dim: int | None
    offset: int
    full_shape: torch.Size
    outer_shape: torch.Size | None = None
    outer_offset: tuple[int, ...] | None = None
    slot: int = 0
    n_slots: int = 1

    def __post_init__(self):
        if self.outer_shape is None:
            object.__setattr__(self, "outer_shape", torch.Size(self.full_shape))
        if self.outer_offset is None:
            object.__setattr__(self, "outer_offset", (0,) * len(self.full_shape))

    @staticmethod
    def of(local: torch.Size, full: torch.Size, rank: int, world: int, **outer) -> ShardSpec:
        """``local``: the shard's shape; ``full``: the outer weight's (FSDP2's
        ``outer_size``); ``outer``: the global placement (see the class doc), if any."""
        outer.setdefault("full_shape", torch.Size(full))
        outer["outer_shape"] = torch.Size(full)
        for dim, (n_local, n_full) in enumerate(zip(local, full, strict=True)):
            if n_local != n_full:
                return ShardSpec(dim, rank * math.ceil(n_full / world), **outer)
        return ShardSpec(None, 0, **outer)

    def global_start(self, dim: int) -> int:
        """The global index of the shard's first slice along ``dim``."""
        start = self.outer_offset[dim]
        return start + self.offset if dim == self.dim else start
