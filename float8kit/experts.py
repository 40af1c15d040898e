"""Float8 MoE expert weights: ``torch._grouped_mm`` over jagged token groups, in float8.

``convert_experts_to_float8_training`` wraps each selected 3-D expert weight (experts, in,
out) in a ``Float8ExpertWeight``, a parameter subclass around the same hp tensor. The model
keeps calling ``torch._grouped_mm(x, w, offs=offs)`` (or ``F.grouped_mm``); the subclass's
``__torch_function__`` sees that call and runs ``_GroupedMM`` instead, whose three
grouped gemms go through ``grouped_gemm.scaled_grouped_mm`` (rowwise):

    output      = x (M,K)      @ w (G,K,N)      scales: per token (row), per expert column
    grad_input  = grad_out (M,N) @ w.T (G,N,K)  scales: per token (row), per expert column
    grad_weight = x.T (K,M)    @ grad_out (M,N) per group: scales per group and row/column

Tokens are sorted by expert: group ``g`` is rows ``offs[g-1]:offs[g]`` (``offs`` int32
cumulative ends, as torch wants). Rowwise scales along the inner dim come from
``scaling`` (dynamic, e4m3: the only float8 grouped kernel); the grad_weight gemm's inner
dim is the jagged token dim, so its scales are per group (``scaling.group_amax``), and an expert
that got no tokens gets an exactly zero gradient.

With an MX ``Float8ExpertsConfig`` (``from_recipe_name("mxfp8")``) ``_GroupedMM`` runs the
same three gemms in MXFP8 (``grouped_gemm.mx_scaled_grouped_mm``): every operand cast from hp by
``formats.mx.to_mx`` along the dim its gemm reduces (one e8m0 scale per 32 elements), token groups
zero-padded to multiples of 32 rows for the grad_weight gemm, whose 32-blocks run along
tokens and so must not straddle two experts.

A converted weight runs in float8 or raises, never in hp silently. Float8 forms: that
grouped call (with ``w`` or ``w.transpose(-2, -1)``); transformers' own
``transformers::grouped_mm_fallback`` (its "grouped_mm" experts under ``torch.compile`` with
non-bf16 weights); and one expert at a time, ``F.linear(x, w[e])`` or ``x @ w[e]`` (its
"eager" experts), run as the grouped gemm with one group. Views and picked experts stay
wrapped so that the checks still see them; any other gemm on the weight (``bmm`` of
"batched_mm", ``mm``, a grouped call in another form) and any op of another library
raise ``NotImplementedError`` naming the op and the fix.

Every other op on the weight (optimizer steps, ``load_state_dict``, FSDP2's sharding) runs on
the hp tensor; ``state_dict`` holds the plain hp tensor. Under FSDP2 the subclass all-gathers
hp, or with ``enable_fsdp_float8_all_gather`` float8 bytes plus the per-expert rowwise scales
(local to the shard: experts are sharded on dim 0) along the dim the output gemm reduces,
and the gathered weight carries its float8 data into the output gemm as is.

Which dim that is depends on how the weight is stored and used: (experts, in, out) as
``w``, or (experts, out, in) as ``w.transpose(-2, -1)``. ``Float8ExpertsConfig.weight_layout``
may say so; by default each weight finds out at its first use. Its first float8 all-gather
assumes (experts, out, in), the common layout; a gathered weight that reaches the gemm the
other way records the layout, and that once casts from the hp shards, gathered in hp (one
extra all-gather per weight, in the first step only), so the numbers are exactly those of
the right guess. Every later all-gather uses the recorded layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.checkpoint import CheckpointFunction

from float8kit import cast, formats, versions
from float8kit.config import E4M3, Float8ExpertsConfig, GemmRole, config_name
from float8kit.formats.base import local_scale_inputs, local_scale_outputs
from float8kit.grouped_gemm import (
    hp_grad_weight,
    mx_scaled_grouped_mm,
    pad_token_groups,
    scaled_grouped_mm,
    token_groups,
)
from float8kit.hp_weight import KEEP_SUBCLASS, HpWeight, padded_shard_size, store_plain_weight
from float8kit.quantized_rows import quantize_rows, rows_format
from float8kit.tensor import Float8TrainingTensor

aten = torch.ops.aten

ParamFilter = Callable[[nn.Parameter, str], bool]

# Ops that keep "the weight" (same values, a view, an expert picked out of it): the hp
# wrapper stays a wrapper, so a gemm on what they return still meets the checks below.
_KEEP_EXPERT = KEEP_SUBCLASS | {
    aten.transpose.int, aten.t.default, aten.permute.default, aten.unbind.int,
    aten.select.int,  # w[expert]: HF's "eager" experts
    aten.index.Tensor,  # w[expert_ids]: HF's "batched_mm" experts
    aten.index_select.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
    aten.expand.default, aten._unsafe_view.default,
}  # fmt: skip
# Gemms below autograd: on an expert weight none of them can run in float8 there.
_GEMM_OPS = {getattr(aten, op) for op in (
    "mm bmm addmm baddbmm addbmm mv addmv dot vdot _grouped_mm _scaled_mm _scaled_grouped_mm "
    "convolution _int_mm").split()}  # fmt: skip
# Op namespaces whose ops on the weight are not gemms (tensor plumbing, collectives, FSDP2's
# copies, float8kit's own). An op of any other library (a custom MoE kernel) is refused.
_PLUMBING_NAMESPACES = {
    "aten", "prims", "c10d", "_c10d_functional", "_c10d_functional_autograd", "fsdp", "_dtensor",
    "inductor",  # compiled autograd's accumulate_grad_, FSDP2's resize_storage_bytes_
    "float8kit",
}  # fmt: skip
# transformers' own grouped gemm, which its "grouped_mm" experts call instead of
# torch._grouped_mm under torch.compile with non-bf16 weights (and on old CPU torch)
_HF_GROUPED_MM = "transformers::grouped_mm_fallback"
_FIX = (
    'for a Hugging Face model use experts_implementation="grouped_mm" (the default in '
    "transformers 5), or keep this weight in hp (param_filter_fn of "
    "convert_experts_to_float8_training)"
)
# Ops on a float8-gathered weight that keep its values; transposes move the scale along.
_FP8_SAME = {aten.detach.default, aten.alias.default, aten.as_strided.default, aten.view.default}
_FP8_TRANSPOSE = {aten.transpose.int, aten.permute.default}
# The layout a float8 all-gather assumes until a weight's first use has shown its own:
# (experts, out, in), used as w.transpose(-2, -1) (torchtitan, most Hugging Face families).
_FIRST_GUESS = "out_in"
_OTHER = {"in_out": "out_in", "out_in": "in_out"}


@dataclasses.dataclass(unsafe_hash=True)  # by value: torch.compile compares flatten contexts
class _Layout:
    """How one expert weight is stored, shared by every wrapper of it (the parameter, its
    FSDP2 shard, the gathered weight and their views); internal.

    ``value``: "in_out", "out_in", or None while undecided (a float8 all-gather then assumes
    ``_FIRST_GUESS``). ``explicit``: set by ``Float8ExpertsConfig.weight_layout``, never
    changed; otherwise the first use of a float8-gathered weight sets it.
    """

    value: str | None
    explicit: bool = dataclasses.field(init=False)

    def __post_init__(self):
        self.explicit = self.value is not None


def _scales_for(layout: str, padded: torch.Tensor, shape) -> torch.Tensor:
    """The gathered weight's scales for ``layout`` from the (experts, max(d1, d2)) padded
    buffer: (E, 1, d2) for "in_out" (reduced over dim 1), (E, d1, 1) for "out_in"."""
    _, d1, d2 = shape
    return padded[:, :d2].unsqueeze(1) if layout == "in_out" else padded[:, :d1].unsqueeze(2)


def _full_hp(weight) -> torch.Tensor:
    """The whole hp expert weight behind a float8-gathered one, as stored: its FSDP2 shards
    all-gathered in hp (an ordinary collective: every rank reaches it in the same use)."""
    shard, mesh = weight._source[:2]
    local = shard._tensor.contiguous()
    if mesh.size() == 1:
        return local
    full = local.new_empty((mesh.size() * local.size(0), *local.shape[1:]))
    getattr(dist, versions.ALL_GATHER_SINGLE)(full, local, group=mesh.get_group())
    return full


# ---------------------------------------------------------------------------- the gemms


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm(x, weight, offs=offs)`` with all three gemms in float8, in the
    format the config's cast names; internal. What is format-specific (how the weight is
    cast for each gemm, the kernel, the grad_weight gemm's casts along the tokens) is its
    gemm family's (``_EXPERT_GEMMS``: ``_RowwiseGemms``, ``_MXGemms``): each returns the
    operands of its kernel (``mm``).

    Invariants: ``x`` is 2-D (M, K) hp (or float8 rows cast for this gemm:
    ``quantized_rows``), sorted by group; ``weight`` is (G, K, N): a ``Float8ExpertWeight``
    (hp, or, rowwise, float8 data + per-expert-column scales from an FSDP2 float8
    all-gather) or a plain hp tensor. Returns (M, N) in ``x``'s dtype, grad_input in ``x``'s
    dtype and grad_weight in the weight's dtype. Saves hp ``x`` (or its float8 rows,
    ``wgrad_operands="dequantized"``) and what the family keeps of the weight. With
    ``wgrad_with_hp`` the grad_weight gemm is ``grouped_gemm.hp_grad_weight`` of the same
    rows (hp, or dequantized), for every family.
    """

    @staticmethod
    def forward(ctx, x, weight, offs, config: Float8ExpertsConfig):
        gemms = _expert_gemms(config)
        w_data, w_scale, w_saved = _weight(weight, config)
        x_data, x_scale = _Rows(x, config, "input").cast()
        x_saved = (x,) if config.wgrad_operands == "hp" else (x_data, x_scale)
        ctx.save_for_backward(*x_saved, offs, *w_saved)
        ctx.n_x, ctx.config, ctx.w_dtype, ctx.x_dtype = len(x_saved), config, weight.dtype, x.dtype
        operands = gemms.output(x_data, x_scale, w_data, w_scale, offs)
        fast = config.gemm_config_output.use_fast_accum  # False for MX (the config says so)
        return gemms.mm(*operands, out_dtype=x.dtype, emulate=config.emulate, use_fast_accum=fast)

    @staticmethod
    def backward(ctx, grad_output):
        c = ctx.config
        gemms = _expert_gemms(c)
        saved = ctx.saved_tensors  # once: checkpointing unpacks each saved tensor once
        x_saved, (offs, *w_saved) = saved[: ctx.n_x], saved[ctx.n_x :]
        go_rows = _Rows(grad_output.contiguous(), c, "grad_output")
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            operands = gemms.grad_input(go_rows.cast(), w_saved, offs, c)
            grad_input = gemms.mm(*operands, out_dtype=ctx.x_dtype, emulate=c.emulate)
        if ctx.needs_input_grad[1]:
            # the input rows the weight-gradient gemm casts along the tokens: hp, or dequantized
            x = x_saved[0] if len(x_saved) == 1 else rows_format(c).dequantize(*x_saved)
            if c.wgrad_with_hp:
                grad_weight = hp_grad_weight(x, go_rows.wgrad(), offs).to(ctx.w_dtype)
            else:
                operands = gemms.grad_weight(x, go_rows.wgrad(), offs, w_saved[0].shape[0], c)
                grad_weight = gemms.mm(*operands, out_dtype=ctx.w_dtype, emulate=c.emulate)
        return grad_input, grad_weight, None, None


def made_by_expert_gemm(t: torch.Tensor) -> bool:
    """``t`` is a float8 expert gemm's output (or a reentrant checkpoint's that reruns it)."""
    return getattr(t.grad_fn, "_forward_cls", None) in (_GroupedMM, CheckpointFunction)


def _cast(t: torch.Tensor, dim: int, config: Float8ExpertsConfig):
    """``(data, scale)`` of ``t`` cast along ``dim`` in the experts' format (dynamic e4m3)."""
    fmt = formats.of(config.cast_config, GemmRole.WEIGHT, dim, t.dim())
    return fmt.quantize_dynamic(t, E4M3, config.cast_config, config.round_scales_to_power_of_2)


def _weight(weight, config):
    """``(data, scale, saved)``: the weight along K for the output gemm, and what backward
    keeps of it (the hp weight, or, rowwise, the FSDP2-gathered float8 data and scales:
    an MX config refuses the float8 all-gather)."""
    if isinstance(weight, Float8ExpertWeight) and weight._scale is not None:
        if weight._scale.size(1) == 1:
            # float8 from the all-gather, scaled along K as this gemm needs: use it as is
            w_data, w_scale = weight._tensor, weight._scale
            if weight._layout.value is None and weight._source is not None:
                weight._layout.value = weight._source[2]  # the first guess was right
        else:
            w_data, w_scale = _cast_gathered_the_other_way(weight)
        return w_data, w_scale, (w_data, w_scale)
    w_hp = weight._tensor if isinstance(weight, Float8ExpertWeight) else weight
    return (*_cast(w_hp, 1, config), (w_hp,))


class _RowwiseGemms:
    """The ``scaled`` family (rowwise scales, ``grouped_gemm.scaled_grouped_mm``).

    The grad_input gemm recasts the output gemm's float8 weight, dequantized, with scales
    along N: for an FSDP2 float8-gathered weight (which has no hp values) and for an hp one
    alike, so both give bitwise the same gradients. A gathered weight whose scales run along
    N here was gathered in the other layout: on its first use (layout undecided, or decided
    since this weight was gathered) the layout is recorded and the weight cast from its hp
    shards instead, the same numbers; otherwise (set in the config, or the weight used both
    ways) it raises. The grad_weight gemm's scales are per token group and row/column
    (``cast.cast_per_group``)."""

    mm = staticmethod(scaled_grouped_mm)

    @staticmethod
    def output(x_data, x_scale, w_data, w_scale, offs):
        groups, _, n = w_data.shape
        return x_data, x_scale.reshape(-1), w_data, w_scale.reshape(groups, n), offs

    @staticmethod
    def grad_input(go, w_saved, offs, config):
        groups, k, _ = w_saved[0].shape
        # the forward's cast again (same amax, same scale: bitwise the same)
        w_data, w_scale = w_saved if len(w_saved) == 2 else _cast(w_saved[0], 1, config)
        # the forward's float8 weight (exact in fp32), recast along N: the same numbers
        # whether that float8 weight came from this cast or from an FSDP2 float8 all-gather,
        # so sharded and single-device training agree bitwise
        w_data, w_scale = _cast(w_data.to(torch.float32) / w_scale, 2, config)  # per expert, K
        return go[0], go[1].reshape(-1), w_data.transpose(-2, -1), w_scale.reshape(groups, k), offs

    @staticmethod
    def grad_weight(x, grad_output, offs, groups, config):
        pow2 = config.round_scales_to_power_of_2
        token_group = token_groups(offs, x.size(0))
        x_data, x_scale = cast.cast_per_group(x, token_group, groups, pow2)
        go_data, go_scale = cast.cast_per_group(grad_output, token_group, groups, pow2)
        return x_data.t(), x_scale.reshape(-1), go_data, go_scale.reshape(-1), offs


class _MXGemms:
    """The ``mx`` family (MXFP8, ``grouped_gemm.mx_scaled_grouped_mm``). Every operand is cast
    from hp by ``formats.mx.to_mx`` along the dim its gemm reduces, never a quantized tensor
    transposed: output = x along K @ weight along K; grad_input = grad_out along N @ weight
    along N; grad_weight = x.T @ grad_out along the tokens, per group, after every token
    group is zero-padded to a multiple of 32 rows in hp (``pad_token_groups``, no host sync)
    so that no 32-block straddles two experts (an expert without tokens sums 32 zero rows:
    an exactly zero gradient). Backward keeps the hp weight. Results come out of the kernel
    (or its emulation) as bf16 and are cast to ``x``'s / the weight's dtype."""

    mm = staticmethod(mx_scaled_grouped_mm)

    @staticmethod
    def output(*operands):
        return operands

    @staticmethod
    def grad_input(go, w_saved, offs, config):
        w_data, w_scale = _cast(w_saved[0], 2, config)  # along N
        return (*go, w_data.transpose(-2, -1), w_scale.transpose(-2, -1), offs)

    @staticmethod
    def grad_weight(x, grad_output, offs, groups, config):
        x_pad, offs_pad, _ = pad_token_groups(x, offs, 32)
        go_pad, _, _ = pad_token_groups(grad_output, offs, 32)
        x_data, x_scale = _cast(x_pad, 0, config)
        return x_data.t(), x_scale.t(), *_cast(go_pad, 0, config), offs_pad


# every expert format's gemm family (``Capabilities.gemm``) -> its expert gemms
_EXPERT_GEMMS = {"scaled": _RowwiseGemms, "mx": _MXGemms}


def _expert_gemms(config: Float8ExpertsConfig):
    return _EXPERT_GEMMS[rows_format(config).capabilities.gemm]


class _Rows:
    """Rows of a grouped gemm (``input`` x, or ``grad_output``): ``cast()`` along their last
    dim (taken as sent when they arrive float8, ``dispatched_rows``: expert parallelism's
    dispatch and combine backward), ``wgrad()`` for the weight-gradient gemm (hp, or the
    dequantized cast)."""

    def __init__(self, rows, config: Float8ExpertsConfig, what: str):
        self.format, self.config = rows_format(config), config
        if isinstance(rows, Float8TrainingTensor):
            _check_rows(rows, config, what)
            self.hp, self.data, self.scale = None, rows._data, rows._scale
        else:
            self.hp, self.data = rows, None

    def cast(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.data is None:
            self.data, self.scale = quantize_rows(self.hp, self.config, self.format)
        return self.data, self.scale

    def wgrad(self) -> torch.Tensor:
        if self.config.wgrad_operands == "hp" and self.hp is not None:
            return self.hp
        return self.format.dequantize(*self.cast())


def _check_rows(rows: Float8TrainingTensor, config: Float8ExpertsConfig, what: str) -> None:
    fmt = rows_format(config)
    if rows._gran != fmt:
        raise ValueError(
            f"float8kit: the expert gemm's {what} arrived as {rows._gran.short()} float8 "
            f"rows, but its Float8ExpertsConfig casts {fmt.short()}: dispatch with the "
            "experts' config"
        )
    if config.wgrad_operands != "dequantized":
        raise ValueError(
            f"float8kit: the expert gemm's {what} arrived in float8 (expert parallelism), so "
            "its weight-gradient gemm has no hp values to cast: set "
            'Float8ExpertsConfig.wgrad_operands="dequantized" (or dispatch in hp: '
            'EPConfig(comm="hp"))'
        )


def _cast_gathered_the_other_way(weight) -> tuple[torch.Tensor, torch.Tensor]:
    """A float8-gathered weight reached the gemm transposed from how it was gathered: record
    the layout its use shows and cast it as this gemm needs, from the hp shards; or raise
    where the layout was already known when it was gathered."""
    layout = weight._layout
    if weight._source is None:
        raise ValueError(
            "float8kit: an expert weight FSDP2 all-gathered in float8 reached "
            "torch._grouped_mm transposed from how it was gathered, inside a compiled graph, "
            "which cannot gather it again in hp: set Float8ExpertsConfig.weight_layout to how "
            'the weights are stored ("in_out" for (experts, in, out) used as w, "out_in" for '
            "(experts, out, in) used as w.transpose(-2, -1)), or run the first step eagerly"
        )
    gathered_as = weight._source[2]
    if layout.value == gathered_as:  # set in the config, or learned before this all-gather
        how = (
            f"Float8ExpertsConfig.weight_layout={layout.value!r} says how they are stored"
            if layout.explicit
            else "this weight reaches torch._grouped_mm both as w and as w.transpose(-2, -1)"
        )
        raise ValueError(
            "float8kit: an expert weight FSDP2 all-gathered in float8 reached "
            "torch._grouped_mm transposed, so its scales run along the dim this gemm does "
            f"not reduce ({how}). Set Float8ExpertsConfig.weight_layout to how the weights "
            'are stored: "out_in" for (experts, out, in) used as w.transpose(-2, -1) (most '
            'Hugging Face MoE models, torchtitan), "in_out" for (experts, in, out) (GPT-OSS), '
            "or None (the default) to have each weight's first use decide; or gather it in "
            "hp (enable_fsdp_float8_all_gather=False)"
        )
    layout.value = _OTHER[gathered_as]  # every later all-gather casts along the right dim
    full = _full_hp(weight)
    return _cast(full if layout.value == "in_out" else full.transpose(-2, -1), 1, weight._config)


def float8_grouped_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``torch._grouped_mm(mat_a, mat_b, offs=offs)`` for a float8 expert weight ``mat_b``:
    the three gemms in float8 (``_GroupedMM``). Raises for a form it does not run in
    float8 (no silent hp fallback)."""
    if (
        isinstance(mat_b, Float8ExpertWeight)
        and not isinstance(mat_a, Float8ExpertWeight)
        and mat_a.dim() == 2
        and mat_b.dim() == 3
        and offs is not None
        and bias is None
        and out_dtype in (None, mat_a.dtype)
    ):
        return _GroupedMM.apply(mat_a, mat_b, offs, mat_b._config)
    raise NotImplementedError(
        "float8kit: a float8 expert weight supports torch._grouped_mm(x, w, offs=offs) with "
        "x 2-D (tokens, in), w the 3-D weight (experts, in, out), no bias and no out_dtype; "
        f"got mat_a {_describe(mat_a)}, mat_b {_describe(mat_b)}, offs {_describe(offs)}, "
        f"bias {_describe(bias)}, out_dtype={out_dtype}. Keep this weight in hp "
        "(param_filter_fn of convert_experts_to_float8_training)"
    )


def _float8_expert_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for one expert's 2-D (in, out) view ``w`` of a float8 expert weight: the
    grouped gemm with a single group (the same scales, so the same numbers, as that expert's
    rows of a grouped call), gradients flowing back through the view into the 3-D weight."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.size(-1))
    offs = torch.full((1,), x2.size(0), dtype=torch.int32, device=x.device)
    out = _GroupedMM.apply(x2, w.unsqueeze(0), offs, w._config)
    return out.reshape(*lead, out.size(-1))


def _is_hp_expert(t) -> bool:
    return isinstance(t, Float8ExpertWeight) and t._scale is None


def _float8_linear(input, weight, bias=None):
    """``F.linear(x, w[e])`` (Hugging Face's "eager" experts): one expert's (out, in) weight,
    in float8."""
    if _is_hp_expert(weight) and weight.dim() == 2 and not isinstance(input, Float8ExpertWeight):
        out = _float8_expert_matmul(input, weight.t())
        return out if bias is None else out + bias
    raise NotImplementedError(_refusal("F.linear", (input, weight, bias)))


def _float8_matmul(a, b, *, out=None):
    """``x @ w[e]`` (GPT-OSS's "eager" experts): one expert's (in, out) weight, in float8."""
    if _is_hp_expert(b) and b.dim() == 2 and not isinstance(a, Float8ExpertWeight) and out is None:
        return _float8_expert_matmul(a, b)
    raise NotImplementedError(_refusal("torch.matmul (@)", (a, b)))


def _op_name(func) -> str | None:
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name
    if isinstance(func, torch._ops.OpOverload):
        return func._schema.name
    return None


def _refusal(op, args=()) -> str:
    shapes = ", ".join(_describe(a) for a in pytree.tree_leaves(args) if a is not None)
    hint = ""
    if "bmm" in str(op):
        hint = (
            ' (Hugging Face\'s experts_implementation="batched_mm" gathers one weight copy per '
            "token and multiplies them with bmm)"
        )
    return (
        f"float8kit: {op} got a float8 expert weight ({shapes}){hint}; it would run in hp, "
        "so it is refused. Expert weights run in float8 through torch._grouped_mm(x, w, "
        "offs=offs) / F.grouped_mm, transformers' grouped_mm_fallback, and one expert at a "
        f"time as F.linear(x, w[e]) or x @ w[e]; {_FIX}"
    )


_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}


# ---------------------------------------------------------------------------- the weight


class Float8ExpertWeight(HpWeight):
    """A 3-D expert weight whose ``torch._grouped_mm`` runs in float8; internal.

    Invariants:
        - ``_tensor`` is the plain tensor this stands for: the hp weight (same shape,
          strides, dtype, device), or, on a weight FSDP2 all-gathered in float8, its e4m3
          data, with ``_scale`` the fp32 multiplying scales (one per expert and column, a
          size-1 dim where they reduce) and ``dtype`` the hp dtype it stands for.
        - ``_config`` is the ``Float8ExpertsConfig`` of the conversion; ``_layout`` the
          ``_Layout`` shared by every wrapper of this weight; on a float8-gathered weight
          ``_source`` is (its FSDP2 shard, the shard mesh, the layout it was gathered in, the
          padded scale buffer ``_scale`` views).
        - ``torch._grouped_mm(x, w, offs=offs)`` with ``w`` this weight, ``x`` 2-D hp, no
          bias and no other out_dtype runs ``_GroupedMM``, as do transformers'
          ``grouped_mm_fallback`` and ``F.linear(x, w[e])`` / ``x @ w[e]`` (one group); any
          other grouped_mm form, gemm (``_GEMM_OPS``) or foreign op raises (no silent hp
          fallback). Other ops run on ``_tensor`` (hp); views, copies and picked experts
          (``_KEEP_EXPERT``) stay wrapped, in-place ops return the wrapper, all else is plain.
    """

    _scale: torch.Tensor | None
    _config: Float8ExpertsConfig
    KEEP = _KEEP_EXPERT

    @staticmethod
    def __new__(cls, tensor, config, scale=None, hp_dtype=None, layout=None, source=None):
        return HpWeight.__new__(cls, tensor, config, scale, hp_dtype)

    def __init__(self, tensor, config, scale=None, hp_dtype=None, layout=None, source=None):
        super().__init__(tensor, config)
        self._scale = scale
        self._layout = layout if layout is not None else _Layout(config.weight_layout)
        self._source = source

    def __repr__(self):
        fp8 = "" if self._scale is None else ", fp8 gathered"
        return f"Float8ExpertWeight(hp={self.dtype}, shape={tuple(self.shape)}{fp8})"

    def __tensor_flatten__(self):
        names = ["_tensor"] if self._scale is None else ["_tensor", "_scale"]
        # no _source: a compiled graph's gathered weight cannot cast from its hp shards
        return names, (self._config, self.dtype, self._layout)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        config, dtype, layout = ctx
        return Float8ExpertWeight(
            inner_tensors["_tensor"], config, inner_tensors.get("_scale"), dtype, layout
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._grouped_mm or _op_name(func) == _HF_GROUPED_MM:
            return float8_grouped_mm(*args, **kwargs)  # transformers' fallback: the same math
        if func is F.linear:
            return _float8_linear(*args, **kwargs)
        if func in _MATMULS:
            return _float8_matmul(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._grouped_mm.default:
            # Below autograd (torch function disabled): running it on the hp tensor would be
            # a silent hp fallback with hp gradients.
            raise NotImplementedError(
                "float8kit: aten._grouped_mm reached a float8 expert weight below autograd "
                "(torch function disabled), where it cannot run in float8: call "
                "torch._grouped_mm / F.grouped_mm with torch function enabled, or keep this "
                "weight in hp (param_filter_fn of convert_experts_to_float8_training)"
            )
        if func.overloadpacket in _GEMM_OPS or func.namespace not in _PLUMBING_NAMESPACES:
            raise NotImplementedError(_refusal(func, (args, kwargs)))
        first = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls))
        if first._scale is not None:
            return _dispatch_fp8(cls, func, args, kwargs, first)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func in cls.KEEP:  # still this weight (FSDP2's shard, a view): the same layout
            for t in pytree.tree_leaves(out):
                if isinstance(t, cls):
                    t._layout = first._layout
        return out

    # ------------------------------------------------------------------------ FSDP2 hooks

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The local shard (whole experts: FSDP2 shards dim 0) as all-gather inputs: hp in
        FSDP2's ``param_dtype``, or with ``enable_fsdp_float8_all_gather`` its e4m3 bytes
        and its per-expert-column scales (computed from the shard alone), as uint8 (gloo
        cannot gather float8 dtypes)."""
        if not self._config.enable_fsdp_float8_all_gather:
            data = self._tensor.to(mp_policy.param_dtype or self.dtype)
            rows = padded_shard_size(self.shape, outer_size, mesh.size())[0]
            if data.size(0) != rows:  # uneven: zero rows up to FSDP2's padded shard
                data = F.pad(data, (0, 0, 0, 0, 0, rows - data.size(0)))
            return (data,), None
        if outer_size[0] % mesh.size():
            # Every rank sees the same sizes, so every rank raises (no hang): FSDP2 needs
            # every all-gather input padded to the shard size, which the scales are not.
            raise ValueError(
                f"float8kit: Float8ExpertsConfig.enable_fsdp_float8_all_gather needs the "
                f"expert count ({outer_size[0]}) to be a multiple of the FSDP2 world size "
                f"({mesh.size()}); use enable_fsdp_float8_all_gather=False for this model"
            )
        # scales along the dim the output gemm reduces: in for (experts, in, out), the
        # stored dim 2 for (experts, out, in), which reaches the gemm transposed
        layout = self._layout.value or _FIRST_GUESS
        data, scale = cast.cast_rowwise(
            self._tensor, 1 if layout == "in_out" else 2, self._config.round_scales_to_power_of_2
        )
        # (experts, max(d1, d2)): the same all-gather sizes in either layout, so a layout
        # decided after the first all-gather reuses FSDP2's buffers
        e, d1, d2 = data.shape
        padded = scale.new_ones((e, max(d1, d2)))
        padded[:, : scale.numel() // e] = scale.reshape(e, -1)
        # the scales are the shard's own: the same all-gather as a dense weight's blocks
        inputs, meta = local_scale_inputs(data, padded, e, 1, mesh.size())
        return inputs, (layout, mesh, meta)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """Wrap the gathered tensors as the unsharded weight. On later all-gathers (``out``
        given) FSDP2 has refilled the buffers that weight's tensors view: nothing to do."""
        if not self._config.enable_fsdp_float8_all_gather:
            if out is not None:
                return None
            (data,) = all_gather_outputs
            return Float8ExpertWeight(data, self._config), (data,)
        layout, mesh, meta = metadata
        if out is not None:
            # FSDP2 refilled the buffers out's data views (on one rank, the scales come as
            # metadata: copy them in); a layout decided since then re-slices the scales
            padded = out._source[3]
            if len(all_gather_outputs) == 1:
                with torch.autograd._unsafe_preserve_version_counter(padded):
                    padded.copy_(meta[0])
            if out._source[2] != layout:
                out._scale = _scales_for(layout, padded, out.shape)
                out._source = (self, mesh, layout, padded)
            return None
        data, padded, free = local_scale_outputs(all_gather_outputs, meta, E4M3, None)
        scale = _scales_for(layout, padded, data.shape)
        source = (self, mesh, layout, padded)
        weight = Float8ExpertWeight(data, self._config, scale, param_dtype, self._layout, source)
        return weight, free


def _dispatch_fp8(cls, func, args, kwargs, weight: Float8ExpertWeight):
    """Ops on a float8-gathered weight: the ones FSDP2 and autograd use on an unsharded
    parameter (views of the same values, transposes, which move the scales along)."""
    moves = func in _FP8_TRANSPOSE
    if moves or func in _FP8_SAME:
        data = func(weight._tensor, *args[1:], **kwargs)
        if moves or data.shape == weight.shape:
            scale = func(weight._scale, *args[1:], **kwargs) if moves else weight._scale
            return cls(data, weight._config, scale, weight.dtype, weight._layout, weight._source)
    raise NotImplementedError(
        f"float8kit: {func} on an expert weight FSDP2 all-gathered in float8 is not "
        "supported (it only feeds torch._grouped_mm); set "
        "Float8ExpertsConfig.enable_fsdp_float8_all_gather=False to gather it in hp"
    )


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    return f"{type(t).__name__}{tuple(t.shape)}"


# ---------------------------------------------------------------------------- conversion


def default_expert_filter(param: nn.Parameter, fqn: str, multiple: int = 16) -> bool:
    """Convert a parameter when it is 3-D (experts, in, out) with ``in`` and ``out``
    multiples of ``multiple``: 16, what the CUDA float8 grouped gemm needs; the conversion
    passes its format's own need (``Format.filter_multiple``: 32 for MX, whose blocks cut
    each of them as the inner dim of one grouped gemm)."""
    return param.dim() == 3 and param.shape[-2] % multiple == 0 and param.shape[-1] % multiple == 0


def _store_plain_experts(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post hook: expert weights as plain hp tensors (DTensors of them under
    FSDP2), sharing storage with the parameters."""
    for name in getattr(module, _EXPERT_PARAMS, ()):
        store_plain_weight(state_dict, prefix, name, Float8ExpertWeight)


_EXPERT_PARAMS = "_float8_expert_params"


def convert_experts_to_float8_training(
    module: nn.Module,
    *,
    config: Float8ExpertsConfig | None = None,
    param_filter_fn: ParamFilter | None = None,
) -> nn.Module:
    """Make every selected 3-D expert weight in ``module`` run ``torch._grouped_mm(x, w,
    offs=offs)`` (and ``F.grouped_mm``) in float8, in place.

    Each selected parameter is replaced, in every module that holds it, by a parameter
    holding a ``Float8ExpertWeight`` around the same storage: module tree, parameter names,
    ``state_dict`` (plain hp tensors) and checkpoints stay as they were. Can be combined
    with ``convert_to_float8_training`` for the model's linears. Call it before
    ``fully_shard``.

    Args:
        module: any module.
        config: how the grouped gemms cast; default ``Float8ExpertsConfig()``.
        param_filter_fn: ``fn(param, fqn) -> bool``; True converts that parameter. Default:
            ``default_expert_filter`` (3-D, last two dims multiples of 16; of 32 with an
            MX config).

    Returns:
        ``module``, converted.

    Raises:
        ValueError: a selected parameter is not 3-D, is already converted with another
            config, or the config is not a ``Float8ExpertsConfig``.
        RuntimeError: a selected parameter is already sharded (a DTensor).
    """
    from torch.distributed.tensor import DTensor

    config = config if config is not None else Float8ExpertsConfig()
    if not isinstance(config, Float8ExpertsConfig):
        raise ValueError(f"config must be a Float8ExpertsConfig, got {config_name(config)}")
    multiple = rows_format(config).filter_multiple(config.cast_config)
    default = functools.partial(default_expert_filter, multiple=multiple)
    keep = param_filter_fn if param_filter_fn is not None else default
    wrapped: dict[int, nn.Parameter] = {}  # id(original) -> its wrapped parameter (ties)
    plan = []
    for fqn, mod in module.named_modules(remove_duplicate=False):
        for name, param in mod.named_parameters(recurse=False):
            full = f"{fqn}.{name}" if fqn else name
            if isinstance(param, Float8ExpertWeight):
                if param._config != config and keep(param, full):
                    raise ValueError(
                        f"convert_experts_to_float8_training: {full} is already converted "
                        f"with another config ({param._config}); convert the plain model once"
                    )
                continue
            if not keep(param, full):
                continue
            if isinstance(param, DTensor):
                raise RuntimeError(
                    f"convert_experts_to_float8_training: {full} is already sharded (a "
                    "DTensor): convert before fully_shard / parallelize_module"
                )
            if param.dim() != 3:
                raise ValueError(
                    f"convert_experts_to_float8_training: {full} has shape "
                    f"{tuple(param.shape)}; expert weights are 3-D (experts, in, out): "
                    "leave it out in param_filter_fn"
                )
            plan.append((mod, name, param))
    for mod, name, param in plan:
        if id(param) not in wrapped:
            wrapped[id(param)] = nn.Parameter(
                Float8ExpertWeight(param.detach(), config), requires_grad=param.requires_grad
            )
        setattr(mod, name, wrapped[id(param)])
        if not hasattr(mod, _EXPERT_PARAMS):
            setattr(mod, _EXPERT_PARAMS, [])
            mod.register_state_dict_post_hook(_store_plain_experts)
        if name not in getattr(mod, _EXPERT_PARAMS):
            getattr(mod, _EXPERT_PARAMS).append(name)
    return module
