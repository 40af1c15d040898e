"""``Float8Linear``: an ``nn.Linear`` whose three gemms run in float8.

The three gemms and the dim of each operand they reduce (where axiswise and block scales
run) are ``config.GEMMS``.

Where each operand's scale comes from is decided in one place, ``cast.operand_scale``, for
the gemms' casts and for the FSDP2 float8 all-gather alike; the layer's DELAYED/STATIC state
(see ``float8kit.state``) reaches it through ``layer.fp8_state.operand`` (inside the
autograd Function, as explicit arguments). Nothing here is distributed: tensor-parallel
DTensors go through ``cast.cast_to_float8`` like plain tensors, and the FSDP2 float8
all-gather weight wrapper is registered from ``float8kit.distributed.fsdp``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from float8kit import formats, ops, scaling, shared_cast, state, versions
from float8kit.cast import (
    cast_to_float8,
    is_recomputing,
    kept_cast,
    one_pass_format,
    operand_scale,
    recast_with_scale,
    record_amax,
    tensorwise_data,
)
from float8kit.config import (
    GEMM_ROLES,
    GEMMS,
    CastConfig,
    Float8LinearConfig,
    GemmRole,
    ScalingType,
)
from float8kit.gemm import GemmPlan, direct_dims, gemm_plan, tensorwise_data_mm
from float8kit.hp_weight import store_plain_weight
from float8kit.tensor import Float8TrainingTensor, dequantize, is_float8, local


def _reusable(first: CastConfig, second: CastConfig, weight: bool = False) -> bool:
    """A tensor cast for one gemm can serve the other when both casts are the same and its
    format lays the operand out alike for both gemms' reduced dims: tensorwise, or a square
    block, which is its own transpose (blockwise and NVFP4 weights)."""
    if first != second or not first.enabled:
        return False
    role = GemmRole.WEIGHT if weight else GemmRole.INPUT
    return formats.of(first, role, -1, 2) == formats.of(first, role, 0, 2)


@dataclasses.dataclass(frozen=True, eq=False)
class LayerPlan:
    """What a layer's config decides for every call, decided once per config (``plan_of``)
    and read by each call as plain values: which casts run, which serve both gemms, which
    operands keep DELAYED/STATIC state and which of their uses records an amax.

    ``index`` is the plan's place in ``_PLANS``: ``_Float8Matmul`` gets a layer's plan as that
    int, which a compiled graph guards with one check, where passing the config itself
    would have dynamo guard each of its fields (the Function is in the graph whole,
    ``allow_in_graph``). Equal configs share a plan; an index is this process's
    (``Float8Linear.__setstate__``)."""

    config: Float8LinearConfig
    index: int
    # one cast serves both gemms that use the operand (``_reusable``)
    reuse_input: bool
    reuse_weight: bool
    reuse_grad_output: bool
    # the format of the weight the output gemm takes
    weight_format: formats.Format
    # some operand keeps DELAYED/STATIC state; ``stale_delayed_warn_after`` if one is DELAYED
    stateful: bool
    delayed_warn_after: int | None
    # the input's DELAYED cast can be shared between layers reading one tensor
    shares_delayed_input: bool
    # per operand (input, weight, grad_output): whether the use of the second gemm records
    # the amax (only where the first use keeps no state: see the stateful_cast validation)
    second_records: tuple[bool, bool, bool]
    # each gemm's name and kernel settings, by name (``config.GEMMS``)
    gemms: dict[str, GemmPlan]
    # an eager call may run the layer's ops on float8 data directly (``_direct_forward``)
    direct: bool = False


_PLANS: list[LayerPlan] = []
_PLAN_INDEX: dict[Float8LinearConfig, int] = {}


def plan_of(config: Float8LinearConfig) -> LayerPlan:
    """The plan of ``config`` (built once per distinct config, kept for the process)."""
    index = _PLAN_INDEX.get(config)
    if index is not None:
        return _PLANS[index]
    c = config
    reuse_input = _reusable(c.cast_config_input, c.cast_config_input_for_grad_weight)
    reuse_weight = _reusable(c.cast_config_weight, c.cast_config_weight_for_grad_input, True)
    reuse_grad_output = _reusable(
        c.cast_config_grad_output, c.cast_config_grad_output_for_grad_weight
    )
    plan = LayerPlan(
        config=c,
        index=len(_PLANS),
        reuse_input=reuse_input,
        reuse_weight=reuse_weight,
        reuse_grad_output=reuse_grad_output,
        weight_format=formats.weight(c.cast_config_weight),
        stateful=any(c.stateful_cast(r) for r in GEMM_ROLES),
        delayed_warn_after=c.stale_delayed_warn_after if state.has_delayed(c) else None,
        shares_delayed_input=reuse_input
        and c.cast_config_input.scaling_type is ScalingType.DELAYED,
        second_records=tuple(
            not getattr(c, first).scaling_type.stateful
            for first, _ in (c.operand_uses()[role] for role in GEMM_ROLES)
        ),
        gemms={g.name: gemm_plan(c, g.name) for g in GEMMS},
        direct=reuse_input and reuse_weight and reuse_grad_output and _direct_config(c),
    )
    _PLANS.append(plan)
    _PLAN_INDEX[config] = plan.index
    return plan


def _direct_config(c: Float8LinearConfig) -> bool:
    """Whether every operand's one cast (``_reusable``) is DYNAMIC and the one-pass tensorwise
    cast's, with no emulation or padding: then an eager call's ops need no float8 tensor
    around them (``_direct_forward``)."""
    return not (c.emulate or c.pad_inner_dim) and all(
        cast.scaling_type is ScalingType.DYNAMIC
        and one_pass_format(formats.of(cast, role, -1, 2), cast.dtype_for(role))
        for role, (first, _) in c.operand_uses().items()
        for cast in (getattr(c, first),)
    )


def _weight_for_grad_input(
    w_saved: torch.Tensor, plan: LayerPlan, state: tuple, recast: tuple | None = None
) -> Float8TrainingTensor:
    """The weight as the grad_input gemm needs it: cast per ``cast_config_weight_for_grad_input``
    with its scales along dim 0 (reducing N) or tensorwise.

    A float8 weight saved by forward serves as is where one cast serves both gemms (the same
    tensorwise or blockwise cast), and so does an FSDP2 weight of a format gathered one copy
    per pass (``Format.copy_per_pass``: MX) that its backward re-gather made this gemm's
    copy; one still the output gemm's copy (no re-gather) has this gemm's gathered now
    (``_fsdp_copy``). Otherwise (the row-scaled weight an FSDP2 float8
    all-gather delivers) it is re-cast from its dequantized values, which are exact.
    Between power-of-2 scales (the config requires them there) the re-cast only shifts
    exponents: it equals casting the hp weight, except for values in float8's subnormal
    range. Never used with the wrong axis: ``scaled_mm`` checks the scales' dim.

    ``recast``: (scale, float8 dtype, granularity) of the output gemm's weight cast, when forward
    kept the hp weight (a parameter, kept anyway) instead of that float8 copy: the same cast
    is redone here with the stored scale, bitwise the copy forward made, and no weight-sized
    float8 tensor lives from forward to backward."""
    config = plan.config
    cast = config.cast_config_weight_for_grad_input
    if recast is not None:
        return recast_with_scale(w_saved, cast, GemmRole.WEIGHT, config, *recast)
    if is_float8(w_saved):  # a Float8TrainingTensor, or a DTensor around one (TP)
        if plan.reuse_weight:
            return w_saved
        have = local(w_saved)._gran
        if have.copy_per_pass:
            if have == formats.of(cast, GemmRole.WEIGHT, 0, 2):  # FSDP2's backward re-gather
                return w_saved
            # no re-gather (reshard_after_forward=False): gather this gemm's copy now
            return _fsdp_copy(w_saved, 0, cast, "grad_input")
        # exact in any hp dtype: float8 values over a power-of-2 scale
        w_saved = dequantize(w_saved)
    # the grad_input gemm takes it column-major: that layout alone, in one pass
    return cast_to_float8(w_saved, cast, GemmRole.WEIGHT, 0, config, *state, col=True, row=False)


def _fsdp_copy(weight: torch.Tensor, dim: int, cast: CastConfig, gemm: str):
    """The copy that the gemm reducing the weight's ``dim`` needs (cast per ``cast``) of an
    FSDP2 float8 all-gather ``weight`` that holds another pass's copy
    (float8kit.distributed.fsdp.regather gathers it from the shards, bitwise the one-device
    cast). Such a format's block is not its own transpose (``Format.copy_per_pass``):
    re-casting the held copy from its dequantized values would not be the cast of the hp
    weight, so a weight with no shards to gather from is refused."""
    got = _FSDP[0][1](weight, dim) if _FSDP else None
    if got is None:
        want = formats.of(cast, GemmRole.WEIGHT, dim, 2).short()
        raise RuntimeError(
            f"float8kit: the {gemm} gemm needs the weight as {want}, but got a float8 weight "
            f"as {local(weight)._gran.short()} that no FSDP2 float8 all-gather can re-gather "
            "(re-casting it would not be the cast of the hp weight): pass the hp weight"
        )
    return got


def input_for_backward(
    input_hp: torch.Tensor,
    x: torch.Tensor,
    plan: LayerPlan,
    x_state: tuple[torch.Tensor | None, torch.Tensor | None, bool],
    share: torch.Tensor | None = None,
    share_key: torch.Tensor | None = None,
    recorded: torch.Tensor | None = None,
    x_col: torch.Tensor | None = None,
) -> torch.Tensor:
    """What ``_Float8Matmul`` saves of the input for its grad_weight gemm (which reduces M,
    the input's dim 0): the one save decision for the input, so that a new granularity
    plugs in here.

    - The same tensorwise cast in both gemms: the output gemm's float8 ``x`` (no new cast),
      column-major (``x_col``) where its cast wrote that layout too, as the grad_weight gemm
      takes it (no copy in backward).
    - A float8 grad_weight gemm with another cast (rowwise: scales along dim 0): that cast,
      done now, in forward, so that 1 byte per element is kept for backward instead of
      the hp input. It is the cast backward would otherwise do on the saved hp input (same
      function, same tensor, same scale state), so the gradients do not change; under
      activation checkpointing the recomputed forward repeats it bit for bit.
    - An hp grad_weight gemm (``rowwise_with_gw_hp``): the hp input itself.

    Args:
        input_hp: the (M, K) hp input.
        x: what the output gemm used: the float8 input, or ``input_hp`` when that gemm is hp.
        plan: the layer's plan (``plan_of``).
        x_state: the input's DELAYED/STATIC state for its second use (``operand_scale``'s
            ``state_scale``, ``amax_record``, ``scale_set``).
        share: the tensor the layer's shared casts are keyed on (``shared_cast.source_for``),
            or None: the float8 copy kept here is stored there, or taken from there when
            another layer already made it from the same tensor in this forward.
        share_key: the scale buffer a DELAYED shared cast is keyed on (the layer's own, or
            the one of the layer it is tied to, see ``Float8Linear.forward``).
        recorded: the amax the cast of ``x`` recorded (DELAYED, train mode), stored with it.
        x_col: ``x`` column-major (the same cast's other layout), or None.
    """
    config = plan.config
    first, second = config.cast_config_input, config.cast_config_input_for_grad_weight
    if plan.reuse_input:
        kept = x if x_col is None else x_col
        if is_float8(x):
            shared_cast.store(share, first, -1, config, input_hp.dtype, kept, share_key, recorded)
        return kept
    # An input that came in float8 (cast before a tensor-parallel all-gather) goes on
    # from its hp values.
    hp = dequantize(input_hp)
    if not second.enabled:
        return hp
    hit = shared_cast.lookup(share, second, 0, config, hp.dtype, share_key)
    if hit is not None:
        return hit[0]
    with kept_cast():  # checkpoint_policy keeps this cast's data
        kept = cast_to_float8(hp, second, GemmRole.INPUT, 0, config, *x_state)
    shared_cast.store(share, second, 0, config, hp.dtype, kept, share_key)
    return kept


# Re-cast the float8 weight in backward rather than keep it (see _Float8Matmul.forward);
# False only in tests, which compare against keeping it.
_RECAST_WEIGHT = True


# a stateless layer's ``states`` (``_Float8Matmul``)
_NO_STATES = (None, None, False) * 3


@torch._dynamo.allow_in_graph
class _Float8Matmul(torch.autograd.Function):
    """``input @ weight.T`` with every operand cast per ``config``; internal.

    Invariants: ``input_hp`` is (..., K), the gemms' (M, K) as one reshape inside (no
    autograd nodes around this one), hp or already float8 (a tensor-parallel input cast before
    its all-gather, float8kit/tp.py; used as is by the output gemm when its cast fits, see
    ``input_for_backward`` for the second use); ``weight`` is (N, K), hp or already a
    ``Float8TrainingTensor`` cast for the output gemm (FSDP2 float8 all-gather: tensorwise,
    blockwise, or rowwise, which backward re-casts, see ``_weight_for_grad_input``; MX, the
    copy along K in forward, along N after FSDP2's backward re-gather), and may have another
    hp dtype than the input (autocast: an fp32 weight is cast to float8 directly, never
    copied to the autocast dtype first). Returns hp (..., N) in the input's dtype. Saves the
    input for backward as its grad_weight gemm uses it (``input_for_backward``: float8, cast
    in forward, unless that gemm runs in hp), and the weight float8 where the grad_input gemm
    casts it as the output gemm did, hp (the parameter) otherwise. Returns grad_input
    (..., K) in the input's dtype and grad_weight (N, K) in the weight's dtype. M == 0 (no
    tokens) gives an empty output and a zero grad_weight, like ``nn.Linear``, without
    casting or recording an amax (an empty batch says nothing about the range of the next
    ones).

    ``plan`` is the layer's ``LayerPlan`` as its index in ``_PLANS``, and ``compiled`` whether
    the call is traced for a compiled graph: dynamo puts this Function in the graph whole
    (``allow_in_graph``) and AOTAutograd traces its body, where torch 2.11 does not report
    compiling (``versions.compiled_trace``).

    DELAYED/STATIC state, ``states``: (scale, amax record, scale set) per operand in
    ``GEMM_ROLES``' order, or None where no operand keeps any: ``*_scale`` is the operand's
    ``fp8_scale_<op>`` buffer (None when the operand keeps no state), ``*_amax`` its
    ``fp8_amax_<op>`` buffer when amaxes are recorded (train mode), else None, ``*_set``
    whether the host knows the DELAYED scale is set (a Python bool: compiled graphs
    specialize on it). ``share`` / ``share_key``: the tensor and the scale buffer its shared
    input casts are keyed on (float8kit/shared_cast.py; ``share_key`` None: ``x_scale``); a
    DELAYED cast taken from there is recorded as this layer's own (its amax folded into
    ``x_amax``), so the state is the one the layer's own cast leaves. The grad_output amax is
    recorded in ``backward`` by an in-place ``clamp_`` of that buffer, which reaches backward
    as a ``ctx`` attribute, not through ``save_for_backward``: the buffer is mutated by every
    call, and a saved tensor's version check would fail when a layer runs twice before its
    backwards (weight tying, activation checkpointing). AOTAutograd traces the mutation of
    this forward input into the compiled backward graph (no graph break; checked in
    tests/test_compile_scaling).
    """

    @staticmethod
    def forward(
        ctx,
        input_hp: torch.Tensor,
        weight: torch.Tensor,
        plan: int,
        states: tuple | None = None,
        share: torch.Tensor | None = None,
        share_key: torch.Tensor | None = None,
        keep_weight_t: bool = True,
        compiled: bool = False,
    ):
        ctx.compiled = compiled
        plan = _PLANS[plan]
        x_scale, x_amax, x_set, w_scale, w_amax, w_set, go_scale, go_amax, go_set = (
            states or _NO_STATES
        )
        with versions.compiled_trace(compiled):
            c = plan.config
            share_key = x_scale if share_key is None else share_key
            x_col, w_col = None, None  # column-major copies from the casts' own passes
            ctx.w_dtype = weight.dtype
            x_shape, lead = input_hp.shape, input_hp.shape[:-1]  # (..., K): the gemms' (M, K)
            if input_hp.dim() != 2:
                input_hp = input_hp.reshape(-1, x_shape[-1])
            ctx.empty = input_hp.shape[0] == 0
            if ctx.empty:
                ctx.shapes = (x_shape, weight.shape, weight.device)
                return input_hp.new_zeros((*lead, weight.shape[0]))
            ctx.direct = plan.direct and _direct_call(input_hp, weight)
            if ctx.direct:
                return _unflatten(_direct_forward(ctx, input_hp, weight, plan, share), lead)
            weight_is_fp8 = is_float8(weight)
            # An FSDP2 weight gathered one copy per pass (MX) as its backward re-gather left it
            # in a forward that activation checkpointing recomputes: the output gemm gathers its
            # own copy; the weight itself is what backward keeps (see _weight_for_grad_input)
            w_fwd = weight
            if weight_is_fp8:
                have = local(weight)._gran
                if have.copy_per_pass and have != plan.weight_format:
                    w_fwd = _fsdp_copy(weight, 1, c.cast_config_weight, "output")
            # The output gemm's float8 weight serves the grad_input gemm too: keep the hp
            # parameter (kept anyway) and the scale, and redo the cast in backward
            # (_weight_for_grad_input), rather than keep a weight-sized float8 copy per layer.
            # A weight that arrived float8 (FSDP2 all-gather) or a DTensor (TP) keeps its copy,
            # and so does a compiled graph, whose partitioner picks what is kept (dynamo also
            # refuses the scale, an intermediate, as a saved tensor of this Function): there the
            # cast writes the grad_input gemm's column-major copy in the same pass and keeps it
            # (1 byte per weight element), except for an FSDP2 weight (``keep_weight_t``
            # False), which FSDP2 frees after forward: its cast stays inductor's, which the
            # partitioner redoes in backward from the re-gathered weight.
            keep_w = weight_is_fp8 or plan.reuse_weight
            recast_w = _RECAST_WEIGHT and plan.reuse_weight
            recast_w = recast_w and not (
                weight_is_fp8 or versions.compiling() or isinstance(weight, DTensor)
            )
            # The input arrives float8 when it was cast before a tensor-parallel all-gather
            # (float8kit/tp.py, which checks that its cast is cast_config_input).
            input_is_fp8 = is_float8(input_hp)
            if input_is_fp8 and not c.cast_config_input.enabled:
                input_hp, input_is_fp8 = dequantize(input_hp), False
            recorded = None  # the amax the input cast recorded (DELAYED, train mode)
            if c.cast_config_input.enabled:
                x = None
                if input_is_fp8:
                    x = input_hp
                elif plan.reuse_input:
                    # another layer's cast of the same tensor (shared_cast: DYNAMIC, or DELAYED
                    # with an equal scale: this layer's, or that of the layer it is tied to)
                    hit = shared_cast.lookup(
                        share, c.cast_config_input, -1, c, input_hp.dtype, share_key
                    )
                    if hit is not None:
                        x, recorded = hit
                        if x_amax is not None:  # record what this layer's own cast would
                            if recorded is None:  # made by a layer that recorded nothing
                                recorded = scaling.recorded_amax(input_hp)
                            record_amax(x_amax, recorded)
                if x is None:
                    # kept for backward too when the grad_weight gemm reuses it (checkpoint_policy),
                    # and then written column-major too, as that gemm takes it, in the same pass;
                    # not inside an eager checkpoint region (saved-tensor hooks), where a policy
                    # that keeps the cast would keep both layouts (backward copies it instead)
                    kept = ctx.needs_input_grad[1] and plan.reuse_input
                    x_col_too = kept and (
                        versions.compiling()
                        or torch._C._autograd._top_saved_tensors_default_hooks(False) is None
                    )
                    amaxes = []
                    with kept_cast() if kept else contextlib.nullcontext():
                        x = cast_to_float8(
                            input_hp, c.cast_config_input, GemmRole.INPUT, -1, c, x_scale, x_amax,
                            x_set, recorded=amaxes, col=x_col_too,
                        )  # fmt: skip
                    if x_col_too:
                        x, x_col = x
                    recorded = amaxes[0] if amaxes else None
                w = w_fwd
                if not weight_is_fp8:
                    # the grad_input gemm's copy (column-major) from the same pass, when kept
                    w_col_too = keep_w and not recast_w and keep_weight_t
                    w = cast_to_float8(
                        weight, c.cast_config_weight, GemmRole.WEIGHT, -1, c, w_scale, w_amax,
                        w_set, col=w_col_too, one_pass=keep_weight_t or not versions.compiling(),
                    )  # fmt: skip
                    if w_col_too:
                        w, w_col = w
                output = ops.mm(x, ops.t(w), plan.gemms["output"])
            else:
                x, w = input_hp, weight
                output = torch.mm(input_hp, dequantize(weight).to(input_hp.dtype).t())

            # The second uses of input and weight record their amax only when the first use
            # did not (see _reusable / the stateful_cast validation).
            x_records, w_records, _ = plan.second_records
            x_state = (x_scale, x_amax if x_records else None, x_set)
            # A frozen weight (no grad_weight gemm) leaves nothing of the input for backward.
            x_saved = (
                input_for_backward(input_hp, x, plan, x_state, share, share_key, recorded, x_col)
                if ctx.needs_input_grad[1]
                else None
            )
            ctx.w_recast, w_scale_kept = None, None
            if recast_w:
                ctx.w_recast, w_scale_kept = (w._data.dtype, w._gran), w._scale
                keep_w = False
            w_keep = weight if w_fwd is not weight else (w if w_col is None else w_col)
            ctx.save_for_backward(x_saved, w_keep if keep_w else weight, w_scale_kept)
            ctx.plan = plan
            ctx.w_state = (w_scale, w_amax if w_records else None, w_set)
            ctx.go_state = (go_scale, go_amax, go_set)
            return _unflatten(output, lead)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # The dtypes here are deliberate (grad_weight in the weight's dtype): autocast, active
        # when backward() is called inside its region, must not recast the gemms' operands.
        with (
            torch.autocast(grad_output.device.type, enabled=False)
            if torch.is_autocast_enabled(grad_output.device.type)
            else contextlib.nullcontext(),
            versions.compiled_trace(ctx.compiled),
        ):
            if ctx.empty:
                x_shape, w_shape, w_device = ctx.shapes
                grad_weight = torch.zeros(w_shape, dtype=ctx.w_dtype, device=w_device)
                grad_input = grad_output.new_zeros(x_shape)
                return grad_input, grad_weight, *(None,) * 6
            plan = ctx.plan
            c = plan.config
            lead = grad_output.shape[:-1]
            if len(lead) != 1:
                grad_output = grad_output.reshape(-1, grad_output.shape[-1])
            grad_output = grad_output.contiguous()
            if ctx.direct:
                grad_input, grad_weight = _direct_backward(ctx, grad_output, plan)
                return _unflatten(grad_input, lead), grad_weight, *(None,) * 6
            x_saved, w_saved, w_scale_kept = ctx.saved_tensors

            # grad_input = grad_output @ weight, reducing N
            go_cast = c.cast_config_grad_output
            go_gw_cast = c.cast_config_grad_output_for_grad_weight
            # the grad_weight gemm takes grad_output transposed: where it reuses this cast, the
            # same pass writes it column-major too
            go_col = None
            if go_cast.enabled:
                both = x_saved is not None and plan.reuse_grad_output
                go = cast_to_float8(
                    grad_output, go_cast, GemmRole.GRAD_OUTPUT, -1, c, *ctx.go_state, col=both
                )
                if both:
                    go, go_col = go
                recast = None if ctx.w_recast is None else (w_scale_kept, *ctx.w_recast)
                w_gi = _weight_for_grad_input(w_saved, plan, ctx.w_state, recast)
                grad_input = ops.mm(go, w_gi, plan.gemms["grad_input"])
            else:
                grad_input = torch.mm(grad_output, dequantize(w_saved).to(grad_output.dtype))

            # grad_weight = grad_output.T @ input, reducing M
            if x_saved is None:
                grad_weight = None
            elif go_gw_cast.enabled:
                go_scale, go_amax, go_set = ctx.go_state
                go_gw_state = (go_scale, go_amax if plan.second_records[2] else None, go_set)
                go_t = (
                    go_col
                    if plan.reuse_grad_output
                    else cast_to_float8(
                        grad_output, go_gw_cast, GemmRole.GRAD_OUTPUT, 0, c, *go_gw_state
                    )
                )
                # x_saved is float8, cast for this gemm in forward (input_for_backward). .to() on
                # a float8 tensor only changes the hp dtype it stands for: the gemm writes the
                # weight's dtype directly (fp32 master weights under autocast).
                grad_weight = ops.mm(
                    ops.t(go_t).to(ctx.w_dtype), x_saved, plan.gemms["grad_weight"]
                )
            else:
                grad_weight = torch.mm(grad_output.t(), dequantize(x_saved).to(grad_output.dtype))
                grad_weight = grad_weight.to(ctx.w_dtype)
            return _unflatten(grad_input, lead), grad_weight, *(None,) * 6


def _unflatten(out: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    """A gemm's (M, X) result with the input's leading dims ``lead`` back. _unsafe_view, as
    torch.matmul does: no view (FSDP2 warns on a module returning one)."""
    return out if len(lead) == 1 else torch.ops.aten._unsafe_view(out, (*lead, out.shape[1]))


# ---------------------------------------------------------------------------- eager, direct
#
# A ``plan.direct`` layer (every operand cast once, DYNAMIC, by the one-pass tensorwise cast)
# called eagerly on plain tensors runs the same ops as the path above, on the float8 data
# itself: no Float8TrainingTensor per operand and per transpose, no per-gemm routing (the
# host time of an eager call, numbers/bench_overhead.json). Bitwise the path above (the
# golden hashes, tests/test_linear). Everything else takes that path: a compiled trace, a
# torch dispatch mode or profiler (``versions.eager_direct``), autocast, saved-tensor hooks
# (activation checkpointing), a subclass input or weight (TP, FSDP2's float8 all-gather),
# and on CUDA dims its kernels would pad or refuse.

_DIRECT_WEIGHTS = (torch.Tensor, nn.Parameter)


def _direct_call(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this call of a ``plan.direct`` layer on the (M, K) ``x`` runs direct."""
    return (
        _RECAST_WEIGHT
        and versions.eager_direct()
        and type(x) is torch.Tensor
        and type(weight) in _DIRECT_WEIGHTS
        and not torch._C._is_any_autocast_enabled()
        and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        and weight.numel() > 0
        and direct_dims(x.shape[0], x.shape[1], weight.shape[0], x.is_cuda)
    )


def _dynamic_scale(hp: torch.Tensor, cast, role: GemmRole, c: Float8LinearConfig):
    """A direct operand's DYNAMIC scale, from its format's amax, as every operand's
    (``operand_scale``)."""
    gran = formats.TENSORWISE  # a direct operand is tensorwise DYNAMIC
    return operand_scale(cast, role, c, gran.amax(hp))


def _direct_forward(ctx, x, weight, plan: LayerPlan, share) -> torch.Tensor:
    """The output gemm of a direct call; saves its input's float8 transpose (the grad_weight
    gemm's operand) and scale, the hp weight and its scale. The input's cast is shared with
    the other layers reading ``share`` as in ``input_for_backward``."""
    c = plan.config
    x_cast, need_w = c.cast_config_input, ctx.needs_input_grad[1]
    hit = shared_cast.lookup(share, x_cast, -1, c, x.dtype)
    if hit is not None:  # the float8 copy another layer kept: (M, K), its layout
        x_scale, x_data = hit[0]._scale, hit[0]._data
        x_t = x_data.t() if need_w else None
    else:
        x_dtype = x_cast.dtype_for(GemmRole.INPUT)
        x_scale = _dynamic_scale(x, x_cast, GemmRole.INPUT, c)
        x_data, x_t = tensorwise_data(x, x_scale, x_dtype, True, need_w)
        if need_w:
            fmt = formats.of(x_cast, GemmRole.INPUT, -1, 2)
            kept = Float8TrainingTensor(x_t.t(), x_scale, x.dtype, GemmRole.INPUT, fmt, c)
            shared_cast.store(share, x_cast, -1, c, x.dtype, kept)
    ctx.w_fp8_dtype = c.cast_config_weight.dtype_for(GemmRole.WEIGHT)
    w_scale = _dynamic_scale(weight, c.cast_config_weight, GemmRole.WEIGHT, c)
    w_data, _ = tensorwise_data(weight, w_scale, ctx.w_fp8_dtype, True, False)
    # what the path above keeps (its input copy holds the data and x_scale): the same bytes
    ctx.save_for_backward(x_t, x_scale, weight, w_scale)
    ctx.plan = plan
    fast = plan.gemms["output"].use_fast_accum
    inv_x, inv_w = scaling.inverse(x_scale), scaling.inverse(w_scale)
    return tensorwise_data_mm(x_data, w_data.t(), inv_x, inv_w, x.dtype, fast)


def _direct_backward(ctx, grad_output: torch.Tensor, plan: LayerPlan) -> tuple:
    """The grad_input and grad_weight gemms of a direct call (grad_weight None for a frozen
    weight); the weight re-cast with the scale forward used."""
    x_t, x_scale, weight, w_scale = ctx.saved_tensors
    c, gemms = plan.config, plan.gemms
    go_dtype = c.cast_config_grad_output.dtype_for(GemmRole.GRAD_OUTPUT)
    go_scale = _dynamic_scale(grad_output, c.cast_config_grad_output, GemmRole.GRAD_OUTPUT, c)
    go_data, go_t = tensorwise_data(grad_output, go_scale, go_dtype, True, x_t is not None)
    _, w_t = tensorwise_data(weight, w_scale, ctx.w_fp8_dtype, False, True)
    inv_go, inv_w = scaling.inverse(go_scale), scaling.inverse(w_scale)
    fast = gemms["grad_input"].use_fast_accum
    grad_input = tensorwise_data_mm(go_data, w_t.t(), inv_go, inv_w, grad_output.dtype, fast)
    if x_t is None:
        return grad_input, None
    fast = gemms["grad_weight"].use_fast_accum
    inv_x = scaling.inverse(x_scale)
    return grad_input, tensorwise_data_mm(go_t, x_t.t(), inv_go, inv_x, weight.dtype, fast)


# The FSDP2 float8 all-gather: float8kit.distributed.fsdp (a layer above this module)
# registers, when float8kit is imported, ``(wrap, regather)``: ``wrap(weight, config)`` makes
# a layer's weight the all-gather weight (its config enables it), ``regather(weight, dim)``
# gathers such a weight's copy for another pass from its shards (``Float8TrainingTensor |
# None``). So this module imports nothing distributed.
_FSDP: list[tuple[Callable, Callable]] = []


def register_fsdp(
    wrap: Callable[[nn.Parameter, Float8LinearConfig], nn.Parameter],
    regather: Callable[[torch.Tensor, int], Float8TrainingTensor | None],
) -> None:
    """Set the functions that make and re-gather the FSDP2 float8 all-gather weight."""
    _FSDP[:] = [(wrap, regather)]


class Float8Linear(nn.Linear):
    """``nn.Linear`` with float8 gemms; same parameters, state_dict keys and init.

    The bias is added in hp. The input must have the weight's dtype, as with ``nn.Linear``
    (an integer or other-precision input raises); under ``torch.autocast`` a floating-point
    input is cast to the autocast dtype and the output has that dtype, as with ``nn.Linear``,
    while the weight goes to float8 straight from its own dtype (no autocast-dtype copy of
    an fp32 weight per forward) and its gradient comes back in its own dtype.

    The float8 state buffers stay fp32 whatever ``.to(dtype)`` / ``.half()`` /
    ``.bfloat16()`` do to the parameters (an fp16 scale overflows: e5m2's 57344 / amax is
    inf for any amax < 0.875); device moves move them. State that comes off the meta device
    (``to_empty`` after a meta-device init) is reset to its initial values, since its memory
    was never written.

    DELAYED/STATIC operands add the buffers documented in ``float8kit.state``
    (``fp8_amax_history_<op>``, ``fp8_amax_<op>``, ``fp8_scale_<op>``). In train mode a
    DELAYED layer records amaxes while casting; in eval mode it only uses its scales.

    With ``config.enable_fsdp_float8_all_gather`` the weight parameter holds a
    ``Float8AllGatherWeight`` (float8kit/fsdp.py) around the hp weight, so that FSDP2
    all-gathers it in float8; ``state_dict`` still holds the plain hp weight.
    """

    def __init__(self, *args, config: Float8LinearConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_float8(config if config is not None else Float8LinearConfig())

    def _init_float8(self, config: Float8LinearConfig) -> None:
        """Set ``config`` and create the float8 state for it: the one init for every way a
        Float8Linear comes to be (``__init__``, ``from_float``, and the in-place class swap
        of a root ``nn.Linear`` in ``convert_to_float8_training``)."""
        self.config = config
        if config.enable_fsdp_float8_all_gather:
            # FSDP2 all-gathers this subclass in float8 (float8kit/distributed/fsdp.py, which
            # registers the wrapper at import); idempotent
            self.weight = _FSDP[0][0](self.weight, config)
        state.init_state(self, config)

    @property
    def config(self) -> Float8LinearConfig:
        return self.__dict__["_config"]

    @config.setter
    def config(self, config: Float8LinearConfig) -> None:
        # what forward reads of it, kept beside it as plain values: a compiled forward then
        # guards these few, not the config's every field
        plan = plan_of(config)
        self.__dict__.update(
            _config=config, _plan=plan, _plan_index=plan.index, _stateful=plan.stateful,
            _delayed_warn_after=plan.delayed_warn_after,
        )  # fmt: skip

    def __setstate__(self, state_: dict) -> None:
        super().__setstate__(state_)
        if "_config" in self.__dict__:
            self.config = self._config  # the plan index is this process's

    def reset_parameters(self) -> None:
        super().reset_parameters()
        # nn.Linear.__init__ calls this before _init_float8; later calls (e.g. after
        # to_empty() in a meta-device init) also reset the float8 state.
        if "_config" in self.__dict__:
            state.reset_state(self, self.config, state.buffer_names(self.config))

    def _apply(self, fn, recurse=True):
        if "_config" not in self.__dict__:  # during nn.Linear.__init__
            return super()._apply(fn, recurse)
        before = {n: self._buffers[n] for n in state.buffer_names(self.config)}
        super()._apply(fn, recurse)
        state.after_apply(self, self.config, before)
        return self

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        # loaded values may differ from the tied layers' (state.Tie): untied
        state.untie_input(self)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )
        state.after_load(self, self.config, state_dict, prefix, missing_keys)
        hint = state.foreign_state_hint(self.config, state_dict, prefix) if strict else None
        if hint:
            errors.append(hint)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        store_plain_weight(destination, prefix)

    @classmethod
    def from_float(cls, mod: nn.Linear, config: Float8LinearConfig | None = None) -> Float8Linear:
        """A ``Float8Linear`` sharing ``mod``'s parameters (same device and dtype): the same
        objects, except a float8-all-gather weight, a new parameter on the same storage."""
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False, config=config)
        new.weight = mod.weight
        new.bias = mod.bias
        new._init_float8(new.config)  # again, now on the weight's device
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        own = self.fp8_state
        if self._stateful and own.uncalibrated:
            raise RuntimeError(
                f"Float8Linear({self.in_features}, {self.out_features}): the STATIC scale of "
                f"{' and '.join(own.uncalibrated)} is not set: run "
                "float8kit.calibrate(model, batches) first, or set CastConfig.static_scale"
            )
        record = self.training
        # A forward that activation checkpointing recomputes in backward is not a new one.
        # (Counted even without the warning: a tie checks its bookkeeping against it.)
        warn_after = self._delayed_warn_after  # None: no DELAYED operand
        if record and warn_after is not None and not is_recomputing():
            state.count_delayed_forward(own.forward_count, warn_after)
        weight = self.weight
        # keyed on the input as passed (before autocast): linears that read one tensor share
        # the float8 copy they keep for backward (float8kit/shared_cast.py)
        compiled = torch.compiler.is_compiling()
        share, passed = None if compiled else shared_cast.source_for(input), input
        device_type = input.device.type if torch._C._is_any_autocast_enabled() else None
        if device_type and torch.is_autocast_enabled(device_type) and input.is_floating_point():
            # Only the input: _Float8Matmul casts an fp32 weight to float8 directly.
            input = input.to(torch.get_autocast_dtype(device_type))
        elif input.dtype != weight.dtype:
            raise RuntimeError(
                f"Float8Linear({self.in_features}, {self.out_features}): input dtype "
                f"{input.dtype} does not match the weight dtype {weight.dtype} (nn.Linear "
                "refuses this too): cast the input with .to(weight.dtype), or run under "
                "torch.autocast for a mixed-precision model"
                + ("" if input.is_floating_point() else "; integer inputs are never accepted")
            )
        share_key = None
        if not compiled and self._plan.shares_delayed_input:
            share_key = self._share_delayed_input(input, passed, share, record)
        # (scale, amax record, scale set) per operand, in GEMM_ROLES' order
        states = (
            tuple(t for role in GEMM_ROLES for t in own.operand(self, role, record))
            if self._stateful
            else None
        )
        output = _Float8Matmul.apply(
            input,
            weight,
            self._plan_index,
            states,
            share,
            share_key,
            # FSDP2 reshards this weight after forward: keep no float8 copy of it till backward
            not self.__dict__.get("_is_fsdp_managed_module", False),  # (set by fully_shard)
            compiled,
        )
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output

    def _share_delayed_input(
        self, input: torch.Tensor, passed: torch.Tensor, share: torch.Tensor | None, record: bool
    ) -> torch.Tensor | None:
        """For a DELAYED input cast that can be shared (eager): tie this layer's input state
        to the first layer that cast ``share`` in this forward where they are equal
        (``state.tie_input``), note this recording forward for its tie (``state.Tie``), and
        return that layer's scale buffer while tied to it (it keys the cast this layer then
        reuses, see ``shared_cast``), else None. ``input``: what the layer casts (after
        autocast); ``passed``: the tensor as passed, by which tied layers' reads compare."""
        c, own = self.config, self.fp8_state
        owner, joined = None, False
        if share is not None and input.numel() > 0:
            owner = shared_cast.delayed_owner(share, c.cast_config_input, c, input.dtype, self)
            if owner is not None:
                joined = state.tie_input(self, owner, input, record)
        tie = own.tie
        if tie is None:
            return None
        if record and not joined and not is_recomputing():
            source = shared_cast.read_source(passed)
            if source is not None:  # an untracked read ends the tie at the next update
                tie.note(self, shared_cast.read_id(source) if input.numel() > 0 else None)
        if owner is not None and state.shares_input(self, owner):
            return owner._buffers[state.scale_name(GemmRole.INPUT)]
        return None

    def extra_repr(self) -> str:
        c = self.config
        short = {GemmRole.INPUT: "i", GemmRole.WEIGHT: "w", GemmRole.GRAD_OUTPUT: "go"}
        parts = []
        for role, fields in c.operand_uses().items():
            first, second = (getattr(c, f) for f in fields)
            text = first.short(role) + ("" if second == first else "/" + second.short(role))
            parts.append(f"{short[role]}:{text}")
        flags = [f for f in ("emulate", "pad_inner_dim") if getattr(c, f)]
        if c.enable_fsdp_float8_all_gather:
            flags.append("fp8_all_gather")
        base = super().extra_repr()
        return f"{base}, cast=[{', '.join(parts)}]" + (f", {', '.join(flags)}" if flags else "")
