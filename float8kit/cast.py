"""The one cast: config + scale state -> scale -> float8 data.

Every hp -> float8 conversion in float8kit happens here, whatever the caller: a linear
layer's operands (plain tensors and tensor-parallel DTensors), an FSDP2 weight shard cast
before its all-gather, MoE expert operands (rowwise, per token group), the blocks of a
gradient sent by the float8 reduce-scatter, and ``copy_`` into a float8 tensor.
``operand_scale`` is the one per-operand scale decision (DYNAMIC / DELAYED / STATIC) for the
gemms' casts, the FSDP2 float8 all-gather and ``precompute_scales``. Amaxes come from
``scaling``; this module applies scales.

Non-finite values stay visible: torch's own ``inf.to(float8_e4m3fn)`` saturates to 448, which
would hide an overflow from a loss scaler. ``to_fp8_saturated`` clamps only finite values and
turns inf/NaN into NaN (e4m3fn has no inf) or keeps them (e5m2 has inf).

Internal.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.distributed.tensor import DTensor, Replicate

from float8kit import formats, scaling, versions
from float8kit.config import (
    E4M3,
    E5M2,
    CastConfig,
    Float8LinearConfig,
    GemmRole,
    ScalingType,
)
from float8kit.formats import (  # noqa: F401  (to_fp8_blocks, to_mx: cast's API too)
    TENSORWISE,
    Format,
    to_fp8_blocks,
    to_fp8_saturated,
    to_mx,
)
from float8kit.tensor import Float8TrainingTensor, local, wrap_local

# ---------------------------------------------------------------------------- saturation


def cast_tensorwise_reference(
    hp: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    guard: bool,
    row: bool,
    col: bool,
    amax: bool,
    placeholders: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``float8kit::cast_tensorwise`` returns, in torch ops (its CPU implementation, and
    the reference its CUDA kernel is checked against): the float8 data of a 2-D ``hp``
    (``to_fp8_saturated``) row-major if ``row``, its transpose made contiguous if ``col``,
    ``max(|hp|)`` as an fp32 scalar if ``amax`` (0 for an empty tensor, NaN if any NaN); an
    empty tensor in place of each output not asked for (None with ``placeholders=False``:
    an eager call's, ``_cast_tensorwise_op``, which allocates nothing it does not use)."""
    hp = hp.contiguous()  # the outputs are contiguous whatever the input's strides (the fake)
    data = to_fp8_saturated(hp, scale, fp8_dtype, guard_non_finite=guard)
    nothing = (lambda d: hp.new_empty((0,), dtype=d)) if placeholders else (lambda d: None)
    amax_value = nothing(torch.float32)
    if amax:
        amax_value = (
            scaling.recorded_amax(hp).to(torch.float32)
            if hp.numel()
            else hp.new_zeros((), dtype=torch.float32)
        )
    return (
        data if row else nothing(fp8_dtype),
        # (clone: .contiguous() of a transposed (1, n) or (m, 1) would be a view of ``data``)
        data.t().clone(memory_format=torch.contiguous_format) if col else nothing(fp8_dtype),
        amax_value,
    )


# One pass over a 2-D hp operand: its tensorwise float8 data in the layouts asked for and,
# if asked, its amax (``cast_tensorwise_reference``, the CPU implementation). An opaque op to
# a compiled graph, whose bytes are its operands: 2 per hp element read (bf16), 1 per float8
# byte written per layout. On CUDA one Triton kernel (float8kit/triton_cast.py) moves
# exactly those; elsewhere the reference runs (torch ops, more passes: CPU is not where
# speed is measured). Without it inductor re-reads the hp tensor for the transposed layout
# (it inlines the cheap cast into the transposing copy) and, for DELAYED, for the amax
# record (a separate reduction): docs/performance.md.
# Defined with torch.library's low-level API, not ``custom_op``: the same schema, fake and
# kernels, without custom_op's Python autograd and dispatch layers, which cost a compiled
# graph's call of the op about three times the host time of the dispatcher alone.
_LIB = torch.library.Library("float8kit", "FRAGMENT")
_LIB.define(
    "cast_tensorwise(Tensor hp, Tensor scale, ScalarType fp8_dtype, bool guard, bool row, "
    "bool col, bool amax) -> (Tensor, Tensor, Tensor)"
)
_LIB.impl("cast_tensorwise", cast_tensorwise_reference, "CompositeExplicitAutograd")
_cast_tensorwise = torch.ops.float8kit.cast_tensorwise.default


@torch.library.register_fake("float8kit::cast_tensorwise")
def _(hp, scale, fp8_dtype, guard, row, col, amax):
    m, n = hp.shape
    return (
        hp.new_empty((m, n) if row else (0,), dtype=fp8_dtype),
        hp.new_empty((n, m) if col else (0,), dtype=fp8_dtype),
        hp.new_empty(() if amax else (0,), dtype=torch.float32),
    )


def _cast_tensorwise_cuda(hp, scale, fp8_dtype, guard, row, col, amax):
    from float8kit import triton_cast

    limit = scaling.fp8_max(fp8_dtype)
    return triton_cast.cast_tensorwise(hp, scale, fp8_dtype, guard, row, col, amax, limit)


_LIB.impl("cast_tensorwise", _cast_tensorwise_cuda, "CUDA")


def _cast_tensorwise_op(hp: torch.Tensor):
    """``float8kit::cast_tensorwise`` for ``hp``, or in eager (``versions.eager_direct``) the
    kernel that op would run on a plain tensor, called without the dispatcher's round trip."""
    if type(hp) in _EAGER_PLAIN and versions.eager_direct():
        return _cast_tensorwise_cuda if hp.is_cuda else _CAST_TENSORWISE_EAGER
    return _cast_tensorwise


def tensorwise_data(
    hp: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, row: bool, col: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """An unguarded (DYNAMIC-scale) tensorwise cast of a plain 2-D ``hp`` in eager
    (``versions.eager_direct``), unwrapped: ``(row-major float8 data, its transpose's
    row-major data)``, None for a layout not asked; the op ``cast_tensorwise`` runs."""
    data, data_t, _ = _cast_tensorwise_op(hp)(hp, scale, fp8_dtype, False, row, col, False)
    return (data if row else None), (data_t if col else None)


def fused_cast_applies(
    hp: torch.Tensor,
    gran: Format,
    fp8_dtype: torch.dtype,
    kind: ScalingType,
) -> bool:
    """Whether ``cast_tensorwise`` casts ``hp``: a plain 2-D tensor (not a DTensor or other
    subclass), tensorwise, to e4m3fn or e5m2; while compiling, not a DYNAMIC cast.

    Under ``torch.compile`` a DYNAMIC cast stays inductor's. An activation's, to fuse with
    the op that produces it (a norm, SiLU, their backward), whose bf16 result inductor may
    feed to the cast unrounded: an opaque op would round it first and move its bits (to
    eager's). A weight's (the same bits either way): the op's dispatch before the first gemm
    cost more than its one-read saving at most Llama shapes on an H200
    (benchmarks/results/2026-11-29-nvidia-h200/cast_op_probe). A DELAYED or STATIC cast takes
    the op, its byte minimum (the amax record in the cast pass, both layouts from one read),
    and then has eager's bits."""
    if versions.compiling() and kind is ScalingType.DYNAMIC:
        return False
    return one_pass_format(gran, fp8_dtype) and hp.dim() == 2 and type(hp) in _PLAIN


def one_pass_format(gran: Format, fp8_dtype: torch.dtype) -> bool:
    """Whether ``cast_tensorwise`` writes this format and float8 dtype: tensorwise e4m3fn or
    e5m2 (what ``fused_cast_applies`` asks of the tensor besides)."""
    return gran is TENSORWISE and fp8_dtype in (E4M3, E5M2)


# A plain tensor, or what stands for one in a trace: AOTAutograd traces an allow_in_graph
# Function (``linear._Float8Matmul``) on functional and fake tensors.
_PLAIN = (torch.Tensor, torch.nn.Parameter, FunctionalTensor, FakeTensor)
_EAGER_PLAIN = (torch.Tensor, torch.nn.Parameter)
_CAST_TENSORWISE_EAGER = functools.partial(cast_tensorwise_reference, placeholders=False)


def cast_tensorwise(
    hp: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    role: GemmRole,
    config: Float8LinearConfig | None,
    *,
    guard: bool,
    row: bool = True,
    col: bool = False,
    amax: bool = False,
) -> tuple[Float8TrainingTensor | None, Float8TrainingTensor | None, torch.Tensor | None]:
    """``float8kit::cast_tensorwise`` of a 2-D ``hp``, wrapped: ``(row-major float8, the same
    values column-major, amax)``, None for what was not asked. Both tensors have ``hp``'s
    shape and the same scale; the column-major one is what a gemm that takes this operand
    transposed reads without a copy."""
    op = _cast_tensorwise_op(hp)
    data, data_t, amax_value = op(hp, scale, fp8_dtype, guard, row, col, amax)

    def wrap(d):
        return Float8TrainingTensor(d, scale, hp.dtype, role, TENSORWISE, config)

    return (
        wrap(data) if row else None,
        wrap(data_t.t()) if col else None,
        amax_value if amax else None,
    )


# ---------------------------------------------------------------------------- operands


def hp_to_float8(
    hp: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    role: GemmRole,
    gran: Format = TENSORWISE,
    config: Float8LinearConfig | None = None,
    *,
    guard_non_finite: bool = True,
) -> Float8TrainingTensor:
    """Cast ``hp`` with a given ``scale`` (fp8 = saturate(hp * scale)), laid out as ``gran``
    says, and wrap it. ``guard_non_finite``: see ``to_fp8_saturated``."""
    data, scale = gran.quantize(hp, scale, fp8_dtype, guard_non_finite)
    return Float8TrainingTensor(data, scale, hp.dtype, role, gran, config)


def operand_scale(
    cast: CastConfig,
    role: GemmRole,
    config: Float8LinearConfig,
    amax: torch.Tensor | None,
    state_scale: torch.Tensor | None = None,
    amax_record: torch.Tensor | None = None,
    scale_set: bool = False,
) -> torch.Tensor:
    """The scale an operand is cast with: the one per-operand scale decision, for the casts in
    ``Float8Linear``'s gemms, the FSDP2 float8 all-gather and ``precompute_scales``.

    Args:
        cast: the operand's cast for this gemm.
        role: which operand (picks the float8 dtype).
        config: the layer's config (power-of-2 rounding).
        amax: the operand's current amax (shape () or per slice; a batch of amaxes gives a
            batch of DYNAMIC scales). Needed by DYNAMIC, and by DELAYED when it records or
            while its scale is not set (``needs_amax``); None otherwise.
        state_scale: DELAYED/STATIC: the layer's ``fp8_scale_<op>`` buffer.
        amax_record: DELAYED, train mode: the layer's ``fp8_amax_<op>`` buffer; ``amax`` is
            folded into it in place (running max until ``precompute_scales``).
        scale_set: DELAYED: the host knows ``state_scale`` is set (``precompute_scales``
            flips this once per layer and operand; see ``state.LayerState.scales_set``).

    Returns:
        DYNAMIC: ``fp8_max / amax``. STATIC: ``state_scale``. DELAYED: ``state_scale``. Until
        the host knows it is set (the first step), ``where(state_scale < 0, dynamic,
        state_scale)``: a tensor op that still scales right if the buffer is unset, at the
        cost of an amax pass; the flag takes that pass off the steady state.
    """
    kind = cast.scaling_type
    if kind is ScalingType.DYNAMIC:
        return scaling.amax_to_scale(amax, cast.dtype_for(role), config.round_scales_to_power_of_2)
    if state_scale is None:
        raise ValueError(f"{kind.name} {role.value} scaling needs the layer's fp8_scale buffer")
    if kind is ScalingType.STATIC:
        return state_scale
    if amax_record is not None:
        record_amax(amax_record, amax)
    if scale_set:
        return state_scale
    dynamic = scaling.amax_to_scale(amax, cast.dtype_for(role), config.round_scales_to_power_of_2)
    return torch.where(state_scale < 0, dynamic, state_scale)


def record_amax(amax_record: torch.Tensor, amax: torch.Tensor) -> None:
    """Fold a DELAYED operand's current ``amax`` into its running record (the layer's
    ``fp8_amax_<op>`` buffer, until ``precompute_scales``). In place on a buffer that was
    passed in: under torch.compile AOTAutograd turns this into a graph-input mutation, in the
    forward and in the backward graph alike. One op (clamp_ keeps NaN, like maximum): the
    recording costs no more than a DYNAMIC scale."""
    amax_record.clamp_(min=amax)


def recast_with_scale(
    hp: torch.Tensor,
    cast: CastConfig,
    role: GemmRole,
    config: Float8LinearConfig,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    gran: Format,
) -> Float8TrainingTensor:
    """Redo a tensorwise or blockwise cast of ``hp`` with the ``scale`` (and float8 dtype and
    granularity) it used before: bitwise the float8 tensor that cast made. A tensorwise one
    is made column-major (the weight's grad_input gemm takes it so): one pass, no copy."""
    guard = cast.scaling_type is not ScalingType.DYNAMIC
    if fused_cast_applies(hp, gran, fp8_dtype, cast.scaling_type):
        _, fp8_col, _ = cast_tensorwise(
            hp, scale, fp8_dtype, role, config, guard=guard, row=False, col=True
        )
        return fp8_col
    return hp_to_float8(hp, scale, fp8_dtype, role, gran, config, guard_non_finite=guard)


def needs_amax(cast: CastConfig, recording: bool, scale_set: bool) -> bool:
    """Whether ``operand_scale`` needs the operand's current amax (an extra read pass)."""
    kind = cast.scaling_type
    if kind is ScalingType.DELAYED:
        return recording or not scale_set
    return kind is ScalingType.DYNAMIC


def cast_to_float8(
    hp: torch.Tensor,
    cast: CastConfig,
    role: GemmRole,
    reduce_dim: int,
    config: Float8LinearConfig,
    state_scale: torch.Tensor | None = None,
    amax_record: torch.Tensor | None = None,
    scale_set: bool = False,
    *,
    recorded: list[torch.Tensor] | None = None,
    col: bool = False,
    one_pass: bool = True,
    row: bool = True,
):
    """Cast ``hp`` to float8 with the scale ``operand_scale`` picks: dynamic from its own
    amax (one scale, or one per slice along ``reduce_dim`` when axiswise), delayed or static
    from the layer's state (``state_scale``, ``amax_record``, ``scale_set``: see
    ``operand_scale``). The amax is computed only when that scale needs it: STATIC never,
    DELAYED in train mode (to record it) or before its scale is set. ``recorded``: a list
    the amax folded into ``amax_record`` is appended to (plain tensors), for a layer that
    reuses this cast and records the same amax (float8kit/shared_cast.py).

    A tensorwise cast of a plain 2-D tensor is one ``float8kit::cast_tensorwise`` pass, which
    also finds a DELAYED cast's recorded amax (its scale is known before the cast). ``col``:
    return ``(row-major, column-major)`` float8 tensors of the same cast, for an operand two
    gemms take with different major-ness (the column-major one comes from the same pass
    where that op applies, from a copy of the float8 data otherwise); with ``row=False`` the
    column-major one alone (where that op applies, only that layout is written). ``one_pass=False``:
    never that op (a compiled graph's cast that the partitioner should be free to redo in
    backward rather than keep)."""
    if isinstance(hp, DTensor):  # tensor parallel
        fp8 = _cast_dtensor(hp, cast, role, reduce_dim, config, state_scale, amax_record, scale_set)
        return _layouts(fp8, fp8, row, col)
    gran = formats.of(cast, role, reduce_dim, hp.dim())
    fp8_dtype = cast.dtype_for(role)
    fused = one_pass and fused_cast_applies(hp, gran, fp8_dtype, cast.scaling_type)
    if cast.scaling_type is ScalingType.DYNAMIC and not fused:
        # the format's own scale rule (amax -> scale; MX's e8m0, NVFP4's two levels)
        data, scale = gran.quantize_dynamic(hp, fp8_dtype, cast, config.round_scales_to_power_of_2)
        fp8 = Float8TrainingTensor(data, scale, hp.dtype, role, gran, config)
        return _layouts(fp8, fp8, row, col)
    amax = None
    record_in_cast = False  # DELAYED with its scale set: the cast pass finds the amax
    if needs_amax(cast, amax_record is not None, scale_set):
        if scale_set and hp.numel() > 0:
            # only recorded (DELAYED, scale set): in the cast pass, or one reduction op in hp
            record_in_cast = fused
            if not fused:
                amax = scaling.recorded_amax(hp)
        else:
            amax = gran.amax(hp)
    scale = operand_scale(
        cast,
        role,
        config,
        amax,
        state_scale,
        None if record_in_cast else amax_record,
        scale_set,
    )
    # A dynamic scale already turns inf/NaN into NaN (scale 0 or NaN): no guard pass needed.
    guard = cast.scaling_type is not ScalingType.DYNAMIC
    if fused:
        fp8, fp8_col, cast_amax = cast_tensorwise(
            hp,
            scale,
            fp8_dtype,
            role,
            config,
            guard=guard,
            row=row or not col,
            col=col,
            amax=record_in_cast,
        )
        if record_in_cast:
            amax = cast_amax
            record_amax(amax_record, amax)
    else:
        fp8 = hp_to_float8(hp, scale, fp8_dtype, role, gran, config, guard_non_finite=guard)
        fp8_col = fp8
    if recorded is not None and amax_record is not None and amax is not None:
        recorded.append(amax)
    return _layouts(fp8, fp8_col, row, col)


def _layouts(fp8, fp8_col, row: bool, col: bool):
    """``cast_to_float8``'s result: both tensors, the column-major one, or the row one."""
    if col:
        return (fp8, fp8_col) if row else fp8_col
    return fp8


def _cast_dtensor(
    hp: DTensor,
    cast: CastConfig,
    role: GemmRole,
    reduce_dim: int,
    config: Float8LinearConfig,
    state_scale: torch.Tensor | None = None,
    amax_record: torch.Tensor | None = None,
    scale_set: bool = False,
) -> DTensor:
    """``cast_to_float8`` for a DTensor (tensor parallel): the same scale decision
    (``operand_scale``) with the amax of the whole tensor, applied to the local tensor;
    returns a DTensor of the same layout around the ``Float8TrainingTensor``.

    A tensorwise scale comes from the amax of the *whole* tensor (one small all-reduce over
    the mesh when the tensor is sharded), so every rank casts with the same scale: the result
    equals casting the unsharded tensor, and the float8 shards can be all-gathered as bytes
    (``float8kit.distributed.tp``). An axiswise scale is one per slice along the gemm's inner
    dim: local where that dim is not sharded (rowwise input scales are per token: no
    collective), all-reduced across the ranks that share a slice where it is. Blockwise
    scales are per block: each rank casts its own shard in its own blocks, no collective."""
    if any(p.is_partial() for p in hp.placements):
        # Casting is not linear: partial sums must be added up in hp first.
        hp = hp.redistribute(
            placements=[Replicate() if p.is_partial() else p for p in hp.placements]
        )
    gran = formats.of(cast, role, reduce_dim, hp.dim())
    if gran.capabilities.tensor_parallel is None:
        raise NotImplementedError(
            f"float8kit: {gran.short()} casts of tensor-parallel DTensors are not supported: "
            "keep these layers out of parallelize_module, or use another recipe under tensor "
            "parallelism"
        )
    if gran.capabilities.tensor_parallel == formats.LOCAL_BLOCKS:
        # Every block's scale is its own: each rank casts its shard in blocks of its own
        # (a partial block at a shard edge is zero-padded, as at a tensor edge), which is a
        # blockwise cast of the local operand the local gemm uses. No collective.
        return wrap_local(cast_to_float8(hp.to_local(), cast, role, reduce_dim, config), hp)
    # DELAYED/STATIC buffers: parallelize_module replicates them as DTensors; the local
    # tensor shares their storage, so a recorded amax lands in the buffer.
    state_scale, amax_record = local(state_scale), local(amax_record)
    amax_value = None
    if needs_amax(cast, amax_record is not None, scale_set):
        amax_value = gran.dtensor_amax(hp)
    scale = operand_scale(cast, role, config, amax_value, state_scale, amax_record, scale_set)
    guard = cast.scaling_type is not ScalingType.DYNAMIC
    fp8 = hp_to_float8(
        hp.to_local(), scale, cast.dtype_for(role), role, gran, config, guard_non_finite=guard
    )
    return wrap_local(fp8, hp)


# ---------------------------------------------------------------------------- other callers


def cast_rowwise(
    hp: torch.Tensor, reduce_dim: int, round_to_pow2: bool, fp8_dtype: torch.dtype = E4M3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic rowwise cast: ``(fp8 data, scale)``, one scale per slice along ``reduce_dim``
    (kept as a size-1 dim). MoE expert operands and their FSDP2 float8 all-gather."""
    amax = scaling.amax(hp, reduce_dim)
    scale = scaling.amax_to_scale(amax, fp8_dtype, round_to_pow2)
    # A dynamic scale already makes inf/NaN NaN (scale 0 or NaN): no guard pass needed.
    return to_fp8_saturated(hp, scale, fp8_dtype, guard_non_finite=False), scale


def cast_per_group(
    hp: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    round_to_pow2: bool,
    fp8_dtype: torch.dtype = E4M3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast (T, D) ``hp`` with one scale per token group and column: ``(fp8 data, (G, D)
    scales)``. Rows past the last group get scale 1 (the grouped gemm ignores them)."""
    amax = scaling.group_amax(hp, groups, num_groups)
    scale = scaling.amax_to_scale(amax, fp8_dtype, round_to_pow2)
    per_row = torch.cat([scale, scale.new_ones((1, scale.size(1)))])[groups]
    return to_fp8_saturated(hp, per_row, fp8_dtype, guard_non_finite=False), scale


def cast_last_dim_blocks(
    hp: torch.Tensor, fp8_dtype: torch.dtype, round_to_pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic cast with one scale per slice along the last dim of ``hp`` (the blocks of a
    flattened gradient): ``(fp8 data, scale)`` with the last dim dropped from the scale."""
    # torch.amax propagates NaN, and an inf amax gives scale 0 (inf * 0 = NaN): a block with
    # a non-finite value arrives all NaN, so no guard pass is needed after the clamp.
    amax = scaling.last_dim_amax(hp)
    scale = scaling.amax_to_scale(amax, fp8_dtype, round_to_pow2)
    return to_fp8_saturated(hp, scale[..., None], fp8_dtype, guard_non_finite=False), scale


def cast_like(dst: Float8TrainingTensor, src: torch.Tensor) -> torch.Tensor:
    """Float8 data of hp ``src`` in ``dst``'s format, with ``dst``'s scale (``copy_``)."""
    return hp_to_float8(src, dst._scale, dst._data.dtype, dst._role, dst._gran)._data


# ---------------------------------------------------------------------------- checkpointing

# How many casts whose float8 copy backward reads are running now (``kept_cast``): eager,
# the policy keeps those casts' data and recomputes the others.
_KEPT_CASTS = 0


class _Marking:
    # a class, not a generator context manager: entered on every eager forward
    def __enter__(self):
        global _KEPT_CASTS
        _KEPT_CASTS += 1

    def __exit__(self, *exc):
        global _KEPT_CASTS
        _KEPT_CASTS -= 1


_MARKING = _Marking()


def kept_casts_running() -> bool:
    """Whether a ``kept_cast`` region is running (eager): ``checkpoint_policy`` keeps its casts."""
    return _KEPT_CASTS > 0


def kept_cast():
    """Marks the casts run inside as ones whose float8 copy backward reads (the input's copy
    for the grad_weight gemm): ``checkpoint_policy(keep_input_casts=True)`` keeps those and
    recomputes every other cast. Nothing while compiling (that policy keeps every cast
    there)."""
    return contextlib.nullcontext() if versions.compiling() else _MARKING


def is_recomputing() -> bool:
    """Whether an eager forward runs as the recomputation of activation checkpointing (inside
    the backward pass), not as a new forward. Compiled graphs recompute inside the compiled
    backward, never by running the Python forward again: False while compiling."""
    if versions.compiling():
        return False
    return torch._C._current_graph_task_id() != -1
