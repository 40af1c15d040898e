"""``Float8Linear``: an ``nn.Linear`` whose three gemms run in float8.

Gemms and the inner (reduced) dim of each operand, which is the dim axiswise scales span:

    output      = input (M,K)        @ weight.T (K,N)    reduce K: input dim -1, weight dim -1
    grad_input  = grad_output (M,N)  @ weight (N,K)      reduce N: grad_output dim -1, weight dim 0
    grad_weight = grad_output.T (N,M) @ input (M,K)      reduce M: grad_output dim 0, input dim 0
"""

from __future__ import annotations

import torch
from torch import nn

from float8kit import scaling
from float8kit.config import CastConfig, Float8LinearConfig, GemmRole, ScalingGranularity
from float8kit.fsdp import store_plain_weight, wrap_weight
from float8kit.tensor import Float8TrainingTensor, hp_to_float8


def cast_to_float8(
    hp: torch.Tensor,
    cast: CastConfig,
    role: GemmRole,
    reduce_dim: int,
    config: Float8LinearConfig,
) -> Float8TrainingTensor:
    """Cast ``hp`` to float8 with a dynamic scale from its own amax: one scale
    (tensorwise) or one per slice along ``reduce_dim`` (axiswise)."""
    fp8_dtype = cast.dtype_for(role)
    axiswise = cast.scaling_granularity is ScalingGranularity.AXISWISE
    amax = scaling.amax(hp, reduce_dim if axiswise else None)
    scale = scaling.amax_to_scale(amax, fp8_dtype, config.round_scales_to_power_of_2)
    return hp_to_float8(hp, scale, fp8_dtype, role, reduce_dim if axiswise else None, config)


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
    """

    @staticmethod
    def forward(ctx, input_hp: torch.Tensor, weight: torch.Tensor, config: Float8LinearConfig):
        c = config
        weight_is_fp8 = isinstance(weight, Float8TrainingTensor)
        if c.cast_config_input.enabled:
            x = cast_to_float8(input_hp, c.cast_config_input, GemmRole.INPUT, -1, c)
            w = weight if weight_is_fp8 else cast_to_float8(
                weight, c.cast_config_weight, GemmRole.WEIGHT, -1, c
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
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        c = ctx.config
        x_saved, w_saved = ctx.saved_tensors
        grad_output = grad_output.contiguous()

        # grad_input = grad_output @ weight, reducing N
        go_cast = c.cast_config_grad_output
        if go_cast.enabled:
            go = cast_to_float8(grad_output, go_cast, GemmRole.GRAD_OUTPUT, -1, c)
            w = w_saved if isinstance(w_saved, Float8TrainingTensor) else cast_to_float8(
                w_saved, c.cast_config_weight_for_grad_input, GemmRole.WEIGHT, 0, c
            )
            grad_input = torch.mm(go, w)
        else:
            grad_input = torch.mm(grad_output, _as_hp(w_saved).to(grad_output.dtype))

        # grad_weight = grad_output.T @ input, reducing M
        go_gw_cast = c.cast_config_grad_output_for_grad_weight
        if go_gw_cast.enabled:
            go_t = go if _reusable(go_cast, go_gw_cast) else cast_to_float8(
                grad_output, go_gw_cast, GemmRole.GRAD_OUTPUT, 0, c
            )
            x = x_saved if isinstance(x_saved, Float8TrainingTensor) else cast_to_float8(
                x_saved, c.cast_config_input_for_grad_weight, GemmRole.INPUT, 0, c
            )
            grad_weight = torch.mm(go_t.t(), x)
        else:
            grad_weight = torch.mm(grad_output.t(), _as_hp(x_saved).to(grad_output.dtype))
        return grad_input, grad_weight, None


class Float8Linear(nn.Linear):
    """``nn.Linear`` with float8 gemms; same parameters, state_dict keys and init.

    The bias is added in hp. Under ``torch.autocast`` the input and weight are first cast to
    the autocast dtype, and the output has that dtype, as with ``nn.Linear``.

    With ``config.enable_fsdp_float8_all_gather`` the weight parameter holds a
    ``Float8AllGatherWeight`` (float8kit/fsdp.py) around the hp weight, so that FSDP2
    all-gathers it in float8; ``state_dict`` still holds the plain hp weight.
    """

    def __init__(self, *args, config: Float8LinearConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.config = config if config is not None else Float8LinearConfig()
        self._init_weight()

    def _init_weight(self) -> None:
        """Give the weight parameter the form ``self.config`` needs; idempotent. Every way of
        making a Float8Linear (constructor, ``from_float``, the in-place class swap in
        ``convert_to_float8_training``) goes through here."""
        if self.config.enable_fsdp_float8_all_gather:
            self.weight = wrap_weight(self.weight, self.config)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        store_plain_weight(destination, prefix)

    @classmethod
    def from_float(
        cls, mod: nn.Linear, config: Float8LinearConfig | None = None
    ) -> Float8Linear:
        """A ``Float8Linear`` sharing ``mod``'s parameters (same device and dtype): the same
        objects, except a float8-all-gather weight, a new parameter on the same storage."""
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False, config=config)
        new.weight = mod.weight
        new.bias = mod.bias
        new._init_weight()
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        device_type = input.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            input, weight = input.to(dtype), weight.to(dtype)
        out_2d = _Float8Matmul.apply(input.reshape(-1, input.shape[-1]), weight, self.config)
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
            ("go", c.cast_config_grad_output, c.cast_config_grad_output_for_grad_weight,
             GemmRole.GRAD_OUTPUT),
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
