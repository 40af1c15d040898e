"""``Float8Linear``: an ``nn.Linear`` whose three gemms run in float8.

Gemms and the inner (reduced) dim of each operand, which is the dim axiswise scales span:

    output      = input (M,K)        @ weight.T (K,N)    reduce K: input dim -1, weight dim -1
    grad_input  = grad_output (M,N)  @ weight (N,K)      reduce N: grad_output dim -1, weight dim 0
    grad_weight = grad_output.T (N,M) @ input (M,K)      reduce M: grad_output dim 0, input dim 0

Where each operand's scale comes from is decided in one place, ``operand_scale``; the layer's
DELAYED/STATIC state (see ``scale_state``) reaches it through ``Float8Linear._scale_for`` or,
inside the autograd Function, as explicit tensor arguments.
"""

from __future__ import annotations

import torch
from torch import nn

from float8kit import scale_state, scaling
from float8kit.config import (
    CastConfig,
    Float8LinearConfig,
    GemmRole,
    ScalingGranularity,
    ScalingType,
)
from float8kit.fsdp import store_plain_weight, wrap_weight
from float8kit.tensor import Float8TrainingTensor, hp_to_float8


def operand_scale(
    cast: CastConfig,
    role: GemmRole,
    config: Float8LinearConfig,
    amax: torch.Tensor | None,
    state_scale: torch.Tensor | None = None,
    amax_record: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scale an operand is cast with: the one per-operand scale decision.

    Args:
        cast: the operand's cast for this gemm.
        role: which operand (picks the float8 dtype).
        config: the layer's config (power-of-2 rounding).
        amax: the operand's current amax (shape () or per slice); unused by STATIC.
        state_scale: DELAYED/STATIC: the layer's ``fp8_scale_<op>`` buffer.
        amax_record: DELAYED, train mode: the layer's ``fp8_amax_<op>`` buffer; ``amax`` is
            folded into it in place (running max until ``precompute_scales``).

    Returns:
        DYNAMIC: ``fp8_max / amax``. STATIC: ``state_scale``. DELAYED: ``state_scale``, or
        while that is unset (before the first ``precompute_scales``) the dynamic scale, so
        the first step scales from its own amax. A tensor op, not a host branch: the same
        compiled graph serves the first step and all later ones.
    """
    kind = cast.scaling_type
    if kind is ScalingType.STATIC:
        if state_scale is None:
            raise ValueError(f"STATIC {role.value} scaling needs the layer's fp8_scale buffer")
        return state_scale
    fp8_dtype = cast.dtype_for(role)
    dynamic = scaling.amax_to_scale(amax, fp8_dtype, config.round_scales_to_power_of_2)
    if kind is ScalingType.DYNAMIC:
        return dynamic
    if state_scale is None:
        raise ValueError(f"DELAYED {role.value} scaling needs the layer's fp8_scale buffer")
    if amax_record is not None:
        # In place on a buffer that was passed in: under torch.compile AOTAutograd turns this
        # into a graph-input mutation, in the forward and in the backward graph alike.
        amax_record.copy_(torch.maximum(amax_record, amax))
    return torch.where(state_scale < 0, dynamic, state_scale)


def cast_to_float8(
    hp: torch.Tensor,
    cast: CastConfig,
    role: GemmRole,
    reduce_dim: int,
    config: Float8LinearConfig,
    state_scale: torch.Tensor | None = None,
    amax_record: torch.Tensor | None = None,
) -> Float8TrainingTensor:
    """Cast ``hp`` to float8 with the scale ``operand_scale`` picks: dynamic from its own
    amax (one scale, or one per slice along ``reduce_dim`` when axiswise), delayed or static
    from the layer's state (``state_scale``, ``amax_record``: see ``operand_scale``)."""
    fp8_dtype = cast.dtype_for(role)
    axiswise = cast.scaling_granularity is ScalingGranularity.AXISWISE
    amax = None
    if cast.scaling_type is not ScalingType.STATIC:
        amax = scaling.amax(hp, reduce_dim if axiswise else None)
    scale = operand_scale(cast, role, config, amax, state_scale, amax_record)
    # A dynamic scale already turns inf/NaN into NaN (scale 0 or NaN): no guard pass needed.
    return hp_to_float8(
        hp,
        scale,
        fp8_dtype,
        role,
        reduce_dim if axiswise else None,
        config,
        guard_non_finite=cast.scaling_type is not ScalingType.DYNAMIC,
    )


def _reusable(first: CastConfig, second: CastConfig) -> bool:
    """A tensor cast for one gemm can serve the other only when both casts are the same
    tensorwise cast (axiswise scales span a different dim in each gemm)."""
    return (
        first == second
        and first.enabled
        and first.scaling_granularity is ScalingGranularity.TENSORWISE
    )


def _as_hp(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize() if isinstance(t, Float8TrainingTensor) else t


class _Float8Matmul(torch.autograd.Function):
    """``input @ weight.T`` with every operand cast per ``config``; internal.

    Invariants: ``input_hp`` is 2-D (M, K) hp; ``weight`` is (N, K), hp or already a
    tensorwise ``Float8TrainingTensor`` (FSDP2 float8 all-gather). Returns hp (M, N) in the
    input's dtype. Saves float8 copies for backward where the backward gemm would cast the
    same tensor the same way (half the bytes of saving hp), hp otherwise. Returns
    grad_input (M, K) and grad_weight (N, K) in hp.

    DELAYED/STATIC state: ``*_scale`` is the operand's ``fp8_scale_<op>`` buffer (None when
    the operand keeps no state), ``*_amax`` its ``fp8_amax_<op>`` buffer when amaxes are
    recorded (train mode), else None. The grad_output amax is recorded in ``backward`` by
    an in-place ``copy_`` into that buffer, which reaches backward as a ``ctx`` attribute,
    not through ``save_for_backward``: the buffer is mutated by every call, and a saved
    tensor's version check would fail when a layer runs twice before its backwards (weight
    tying, activation checkpointing). AOTAutograd traces the mutation of this forward input
    into the compiled backward graph (no graph break; checked in tests/test_compile_scaling).
    """

    @staticmethod
    def forward(
        ctx,
        input_hp: torch.Tensor,
        weight: torch.Tensor,
        config: Float8LinearConfig,
        x_scale: torch.Tensor | None = None,
        x_amax: torch.Tensor | None = None,
        w_scale: torch.Tensor | None = None,
        w_amax: torch.Tensor | None = None,
        go_scale: torch.Tensor | None = None,
        go_amax: torch.Tensor | None = None,
    ):
        c = config
        weight_is_fp8 = isinstance(weight, Float8TrainingTensor)
        if c.cast_config_input.enabled:
            x = cast_to_float8(
                input_hp, c.cast_config_input, GemmRole.INPUT, -1, c, x_scale, x_amax
            )
            w = (
                weight
                if weight_is_fp8
                else cast_to_float8(
                    weight, c.cast_config_weight, GemmRole.WEIGHT, -1, c, w_scale, w_amax
                )
            )
            output = torch.mm(x, w.t())
        else:
            x, w = input_hp, weight
            output = torch.mm(input_hp, _as_hp(weight).t())

        keep_x = _reusable(c.cast_config_input, c.cast_config_input_for_grad_weight)
        keep_w = weight_is_fp8 or _reusable(
            c.cast_config_weight, c.cast_config_weight_for_grad_input
        )
        ctx.save_for_backward(x if keep_x else input_hp, w if keep_w else weight)
        ctx.config = c
        # The second uses of input and weight record their amax only when the first use
        # did not (see _reusable / the stateful_cast validation).
        ctx.x_state = (x_scale, None if c.cast_config_input.scaling_type.stateful else x_amax)
        ctx.w_state = (w_scale, None if c.cast_config_weight.scaling_type.stateful else w_amax)
        ctx.go_state = (go_scale, go_amax)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        c = ctx.config
        x_saved, w_saved = ctx.saved_tensors
        grad_output = grad_output.contiguous()

        # grad_input = grad_output @ weight, reducing N
        go_cast = c.cast_config_grad_output
        if go_cast.enabled:
            go = cast_to_float8(grad_output, go_cast, GemmRole.GRAD_OUTPUT, -1, c, *ctx.go_state)
            w = (
                w_saved
                if isinstance(w_saved, Float8TrainingTensor)
                else cast_to_float8(
                    w_saved,
                    c.cast_config_weight_for_grad_input,
                    GemmRole.WEIGHT,
                    0,
                    c,
                    *ctx.w_state,
                )
            )
            grad_input = torch.mm(go, w)
        else:
            grad_input = torch.mm(grad_output, _as_hp(w_saved).to(grad_output.dtype))

        # grad_weight = grad_output.T @ input, reducing M
        go_gw_cast = c.cast_config_grad_output_for_grad_weight
        if go_gw_cast.enabled:
            go_gw_state = (
                ctx.go_state if not go_cast.scaling_type.stateful else (ctx.go_state[0], None)
            )
            go_t = (
                go
                if _reusable(go_cast, go_gw_cast)
                else cast_to_float8(
                    grad_output, go_gw_cast, GemmRole.GRAD_OUTPUT, 0, c, *go_gw_state
                )
            )
            x = (
                x_saved
                if isinstance(x_saved, Float8TrainingTensor)
                else cast_to_float8(
                    x_saved, c.cast_config_input_for_grad_weight, GemmRole.INPUT, 0, c, *ctx.x_state
                )
            )
            grad_weight = torch.mm(go_t.t(), x)
        else:
            grad_weight = torch.mm(grad_output.t(), _as_hp(x_saved).to(grad_output.dtype))
        return grad_input, grad_weight, None, None, None, None, None, None, None


class Float8Linear(nn.Linear):
    """``nn.Linear`` with float8 gemms; same parameters, state_dict keys and init.

    The bias is added in hp. Under ``torch.autocast`` the input and weight are first cast to
    the autocast dtype, and the output has that dtype, as with ``nn.Linear``.

    DELAYED/STATIC operands add the buffers documented in ``float8kit.scale_state``
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
            # FSDP2 all-gathers this subclass in float8 (float8kit/fsdp.py); idempotent
            self.weight = wrap_weight(self.weight, config)
        scale_state.init_state(self, config)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        # nn.Linear.__init__ calls this before _init_float8; later calls (e.g. after
        # to_empty() in a meta-device init) also reset the float8 state.
        if "config" in self.__dict__:
            scale_state.reset_state(self, self.config, scale_state.buffer_names(self.config))

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )
        scale_state.after_load(self, self.config, state_dict, prefix, missing_keys)

    def _operand_state(
        self, role: GemmRole, record: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(``fp8_scale_<op>``, ``fp8_amax_<op>`` if DELAYED and ``record``), Nones if the
        operand keeps no state."""
        cast = self.config.stateful_cast(role)
        if cast is None:
            return None, None
        scale = self._buffers[scale_state.scale_name(role)]
        if record and cast.scaling_type is ScalingType.DELAYED:
            return scale, self._buffers[scale_state.amax_name(role)]
        return scale, None

    def _scale_for(self, role: GemmRole, amax: torch.Tensor | None = None) -> torch.Tensor:
        """The tensorwise scale this layer casts operand ``role`` with in its first gemm.

        For code that casts an operand outside ``forward`` (the FSDP2 float8 all-gather of
        the weight). ``amax`` is the operand's current amax: needed for DYNAMIC, and for
        DELAYED (recorded in train mode, and the scale before the first
        ``precompute_scales``): for a shard, pass the amax of the whole tensor. STATIC
        ignores it.
        """
        c = self.config
        cast = c.stateful_cast(role) or getattr(c, c.operand_uses()[role][0])
        state_scale, amax_record = self._operand_state(role, self.training)
        return operand_scale(cast, role, c, amax, state_scale, amax_record)

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
        c = self.config
        if self._fp8_uncalibrated:
            raise RuntimeError(
                f"Float8Linear({self.in_features}, {self.out_features}): the STATIC scale of "
                f"{' and '.join(self._fp8_uncalibrated)} is not set: run "
                "float8kit.calibrate(model, batches) first, or set CastConfig.static_scale"
            )
        record = self.training
        if record and c.stale_delayed_warn_after and scale_state.has_delayed(c):
            scale_state.count_delayed_forward(self._fp8_forward_count, c.stale_delayed_warn_after)
        weight = self.weight
        device_type = input.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            input, weight = input.to(dtype), weight.to(dtype)
        # (x_scale, x_amax, w_scale, w_amax, go_scale, go_amax): GemmRole's order
        states = [t for role in GemmRole for t in self._operand_state(role, record)]
        out_2d = _Float8Matmul.apply(input.reshape(-1, input.shape[-1]), weight, c, *states)
        # _unsafe_view, as torch.matmul does: the output is not an autograd view of out_2d,
        # like nn.Linear's (FSDP2 warns on every forward of a module that returns a view).
        output = torch.ops.aten._unsafe_view(out_2d, (*input.shape[:-1], out_2d.shape[-1]))
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output

    def extra_repr(self) -> str:
        c = self.config
        casts = [
            ("i", c.cast_config_input, c.cast_config_input_for_grad_weight, GemmRole.INPUT),
            ("w", c.cast_config_weight, c.cast_config_weight_for_grad_input, GemmRole.WEIGHT),
            (
                "go",
                c.cast_config_grad_output,
                c.cast_config_grad_output_for_grad_weight,
                GemmRole.GRAD_OUTPUT,
            ),
        ]
        parts = []
        for name, first, second, role in casts:
            text = first.short(role)
            if second != first:
                text += "/" + second.short(role)
            parts.append(f"{name}:{text}")
        flags = [f for f in ("emulate", "pad_inner_dim") if getattr(c, f)]
        if c.enable_fsdp_float8_all_gather:
            flags.append("fp8_all_gather")
        base = super().extra_repr()
        return f"{base}, cast=[{', '.join(parts)}]" + (f", {', '.join(flags)}" if flags else "")
