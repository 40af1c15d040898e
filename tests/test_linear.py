"""Float8Linear against an fp32 nn.Linear (SQNR in dB), plus the module's contract."""

import contextlib
import copy
import dataclasses
import math

import pytest
import torch
from expecttest import assert_expected_inline
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from float8kit import (
    Float8Linear,
    Float8LinearConfig,
    precompute_float8_dynamic_scale_for_fsdp,
    precompute_scales,
)
from tests.helpers import count_scaled_mm, fp32_copy, fwd_bwd, recipes, sqnr

# The thresholds: output / grad_input / grad_weight SQNR in dB vs fp32.
# SQNR floors (dB) of one layer against fp32: output, grad_input, grad_weight. Measured with
# a margin of 2.5 dB or more; NVFP4's 4-bit elements sit near 15-17 dB.
THRESHOLDS = {
    "tensorwise": (25, 20, 20),
    "rowwise": (25, 25, 25),
    "rowwise_with_gw_hp": (25, 25, 25),
    "delayed": (25, 20, 20),  # the first call casts as tensorwise (no history yet)
    "blockwise": (25, 25, 25),
    "mxfp8": (25, 25, 25),
    "nvfp4": (14, 12.5, 13),
}


def test_every_recipe_has_its_sqnr_floor():
    # the tests below run every named recipe (from the format registry): a new one needs
    # its floors here
    assert list(THRESHOLDS) == recipes()


def layer(recipe="tensorwise", bias=True, dtype=torch.bfloat16, k=256, n=128):
    hp = nn.Linear(k, n, bias=bias).to(dtype)
    return hp, Float8Linear.from_float(
        fp32_copy(hp).to(dtype), config=Float8LinearConfig.from_recipe_name(recipe)
    )


@pytest.mark.parametrize("recipe", recipes())
def test_sqnr_vs_fp32_on_bf16_3d_inputs(recipe):
    hp, f8 = layer(recipe)
    x = torch.randn(4, 64, 256, dtype=torch.bfloat16)
    grad = torch.randn(4, 64, 128)
    ref_out, ref_gx, ref_g = fwd_bwd(fp32_copy(hp), x.float(), grad)
    out, gx, g = fwd_bwd(f8, x, grad)
    assert out.shape == (4, 64, 128) and out.dtype == torch.bfloat16
    measured = (sqnr(ref_out, out), sqnr(ref_gx, gx), sqnr(ref_g["weight"], g["weight"]))
    for got, want, name in zip(measured, THRESHOLDS[recipe], ["out", "gx", "gw"], strict=True):
        assert got >= want, f"{recipe} {name}: {got:.1f} dB < {want} dB"
    # the bias is added in hp: its grad matches the bf16 nn.Linear's (a sum of grad_output)
    hp_bias_grad = fwd_bwd(hp, x, grad)[2]["bias"]
    assert sqnr(hp_bias_grad, g["bias"]) >= 40


@pytest.mark.parametrize("shape", [(64, 256), (2, 3, 8, 256), (256,)])
def test_2d_and_nd_inputs(shape):
    # any leading dims: one autograd node for the gemms (no view nodes around it), and the
    # bits of one 2-D call on the flattened rows
    hp, f8 = layer(bias=False)
    flat = copy.deepcopy(f8)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    grad = torch.randn(*shape[:-1], 128, dtype=torch.bfloat16)
    out, gx, g = fwd_bwd(f8, x, grad)
    assert out.shape == (*shape[:-1], 128) and gx.shape == x.shape
    assert sqnr(fp32_copy(hp)(x.float()), out) >= 25
    ref, ref_gx, ref_g = fwd_bwd(flat, x.reshape(-1, 256), grad.reshape(-1, 128))
    assert torch.equal(out.reshape(-1, 128), ref) and torch.equal(gx.reshape(-1, 256), ref_gx)
    assert torch.equal(g["weight"], ref_g["weight"])
    node = f8(x.requires_grad_()).grad_fn
    assert type(node).__name__ == "_Float8MatmulBackward"


def test_from_float_keeps_parameters_device_and_dtype():
    hp = nn.Linear(64, 32).to(torch.bfloat16)
    f8 = Float8Linear.from_float(hp)
    assert f8.weight is hp.weight and f8.bias is hp.bias
    assert f8.weight.dtype == torch.bfloat16 and f8.weight.device == hp.weight.device
    assert list(f8.state_dict()) == ["weight", "bias"]


def test_autocast_gives_the_autocast_dtype():
    hp, f8 = layer(dtype=torch.float32)
    x = torch.randn(64, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = f8(x)
        ref = hp(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert sqnr(fp32_copy(hp)(x), out) >= 25
    out.float().sum().backward()
    assert f8.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("recipe", recipes())
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_non_finite_input_gives_non_finite_output_and_grads(recipe, bad):
    _, f8 = layer(recipe)
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    x[3, 7] = bad
    x.requires_grad_()
    out = f8(x)
    assert not torch.isfinite(out[3]).any(), "a non-finite input was saturated away"
    out.float().sum().backward()
    assert not torch.isfinite(f8.weight.grad).all()


def test_zero_input_gives_zero_output():
    _, f8 = layer(bias=False)
    x = torch.zeros(16, 256, dtype=torch.bfloat16, requires_grad=True)
    out = f8(x)
    assert torch.equal(out, torch.zeros_like(out))
    out.float().sum().backward()
    assert torch.isfinite(x.grad).all() and torch.equal(f8.weight.grad, torch.zeros_like(f8.weight))


def test_emulate_matches_kernel_path():
    hp, f8 = layer("rowwise")
    emu = Float8Linear.from_float(
        fp32_copy(hp).to(torch.bfloat16),
        config=Float8LinearConfig(**{**f8.config.__dict__, "emulate": True}),
    )
    x, grad = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(64, 128)
    for a, b in zip(fwd_bwd(f8, x, grad)[:2], fwd_bwd(emu, x, grad)[:2], strict=True):
        assert sqnr(a, b) > 40  # same math; differs only by bf16 output rounding order


def test_precompute_scales_is_a_correct_no_op_for_dynamic_scaling():
    _, f8 = layer()
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    before = f8(x)
    precompute_scales(f8)
    assert torch.equal(f8(x), before)
    assert precompute_float8_dynamic_scale_for_fsdp is precompute_scales


def test_extra_repr():
    _, tw = layer()
    _, gw = layer("rowwise_with_gw_hp", bias=False)
    assert_expected_inline(
        repr(tw),
        """Float8Linear(in_features=256, out_features=128, bias=True, cast=[i:dyn_tensor_e4m3, w:dyn_tensor_e4m3, go:dyn_tensor_e5m2])""",  # noqa: E501
    )
    assert_expected_inline(
        repr(gw),
        """Float8Linear(in_features=256, out_features=128, bias=False, cast=[i:dyn_axis_e4m3/hp, w:dyn_axis_e4m3/dyn_tensor_e4m3, go:dyn_axis_e4m3/hp])""",  # noqa: E501
    )


# ---------------------------------------------------------------------------- edge inputs

# every recipe whose formats take the edge tests' 64x32 layers (from the format registry)
EDGE_RECIPES = recipes(lambda caps: caps.layer_multiple is None or 32 % caps.layer_multiple == 0)


@pytest.mark.parametrize("recipe", EDGE_RECIPES)
@pytest.mark.parametrize("shape", [(0, 64), (3, 0, 64)])
def test_empty_batch_behaves_like_nn_linear(recipe, shape):
    # an MoE expert that gets no tokens: 0.1.0 raised in torch.amax
    hp, f8 = layer(recipe, k=64, n=32)
    state = {k: v.clone() for k, v in f8.state_dict().items()}
    x = torch.randn(*shape, dtype=torch.bfloat16)
    grad = torch.randn(*shape[:-1], 32)
    ref_out, ref_gx, ref_g = fwd_bwd(hp, x, grad)
    with count_scaled_mm() as calls:
        out, gx, g = fwd_bwd(f8, x, grad)
    assert len(calls) == 0
    assert out.shape == ref_out.shape == (*shape[:-1], 32) and out.dtype == ref_out.dtype
    assert gx.shape == ref_gx.shape and gx.dtype == ref_gx.dtype
    for name in ("weight", "bias"):
        assert g[name].dtype == ref_g[name].dtype and torch.equal(g[name], ref_g[name])
        assert torch.equal(g[name], torch.zeros_like(g[name]))
    # a DELAYED layer records nothing from an empty batch: its next scales are unchanged
    precompute_scales(f8)
    for key, value in f8.state_dict().items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize(
    "layer_dtype, input_dtype",
    [
        (torch.float32, torch.int64),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.int32),
    ],
)
def test_input_dtype_must_match_like_nn_linear(layer_dtype, input_dtype):
    # 0.1.0 truncated integer inputs (an int64 output of zeros) and took mixed hp dtypes
    hp, f8 = layer(dtype=layer_dtype, k=64, n=32)
    x = torch.randn(8, 64).mul(4).to(input_dtype)
    with pytest.raises(RuntimeError, match="same dtype"):
        hp(x)
    with pytest.raises(
        RuntimeError,
        match=f"input dtype {input_dtype} does not match the weight dtype {layer_dtype}",
    ):
        f8(x)


def test_autocast_dtype_rules_match_nn_linear():
    hp, f8 = layer(dtype=torch.float32, k=64, n=32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for dtype in (torch.float32, torch.bfloat16):  # floating inputs are cast
            x = torch.randn(8, 64, dtype=dtype)
            ref, out = hp(x), f8(x)
            assert out.dtype == ref.dtype == torch.bfloat16
            assert sqnr(ref, out) >= 25
        ints = torch.ones(8, 64, dtype=torch.int64)
        with pytest.raises(RuntimeError):
            hp(ints)
        with pytest.raises(RuntimeError, match="integer inputs are never accepted"):
            f8(ints)


class _Bf16CopiesOfShape(TorchDispatchMode):
    """Counts conversions of an fp32 tensor of a given shape (the weight) to bf16: aten ops
    that take such a tensor and produce a bf16 one of the same shape. (Not any bf16 output
    of that shape: a grad_weight computed in bf16, or an input padded to 128-row blocks,
    can share it without copying the weight.)"""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fp32_in = any(
            isinstance(a, torch.Tensor)
            and a.dtype == torch.float32
            and tuple(a.shape) == self.shape
            for a in args
        )
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and fp32_in:
                self.count += tuple(t.shape) == self.shape
        return out


@pytest.mark.parametrize("recipe", recipes())
def test_autocast_casts_fp32_weight_to_float8_without_a_bf16_copy(recipe):
    # 0.1.0 made a bf16 copy of every fp32 weight per forward before the float8 cast
    hp, f8 = layer(recipe, dtype=torch.float32)
    x, grad = torch.randn(64, 256), torch.randn(64, 128)
    ref_out, ref_gx, ref_g = fwd_bwd(hp, x, grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with _Bf16CopiesOfShape(hp.weight.shape) as hp_copies:
            fwd_bwd(hp, x, grad)
        with _Bf16CopiesOfShape(f8.weight.shape) as copies:
            out, gx, g = fwd_bwd(f8, x, grad)
    assert hp_copies.count >= 1  # the counter sees nn.Linear's autocast copy of its weight
    assert copies.count == 0
    assert out.dtype == torch.bfloat16 and g["weight"].dtype == torch.float32
    # at least as accurate as the bf16 weight copy was (thresholds of the bf16 test above)
    want = THRESHOLDS[recipe]
    assert sqnr(ref_out, out) >= want[0]
    assert sqnr(ref_gx, gx) >= want[1]
    assert sqnr(ref_g["weight"], g["weight"]) >= want[2]


def test_plan_index_follows_the_config_through_copies_and_pickles():
    """The Function gets a layer's plan as an index into this process's plans, one per
    distinct config (float8kit.linear._PLANS): a config switched on the layer, a deepcopy
    and a pickle round trip (as if in another process, where the index would name another
    config) each run their own config, bitwise the layer they came from."""
    import copy
    import io
    import pickle

    from float8kit import linear as linear_mod

    def run(module):
        out, grad_input, grads = fwd_bwd(module, x, go)
        return [out, grad_input, *grads.values()]

    _, lin = layer("rowwise")
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    go = torch.randn(32, 128, dtype=torch.bfloat16)
    want = run(lin)
    assert linear_mod._PLANS[lin._plan_index].config == lin.config
    # another process interns configs in another order: an index that names another config
    # here must not be taken over by a copy or a pickle
    good = lin._plan_index
    lin.__dict__["_plan_index"] = linear_mod.plan_of(
        Float8LinearConfig.from_recipe_name("tensorwise")
    ).index
    copied = copy.deepcopy(lin)
    buf = io.BytesIO()
    pickle.dump(lin, buf)
    lin.__dict__["_plan_index"] = good
    buf.seek(0)
    unpickled = pickle.load(buf)
    for other in (copied, unpickled):
        assert other.config == lin.config
        assert linear_mod._PLANS[other._plan_index].config == lin.config
        for got, ref in zip(run(other), want, strict=True):
            assert torch.equal(got, ref)
    # a config switched on the layer switches what its gemms run
    lin.config = Float8LinearConfig.from_recipe_name("tensorwise")
    _, tensorwise = layer("tensorwise")
    tensorwise.load_state_dict(lin.state_dict())
    assert not torch.equal(run(lin)[0], want[0])
    for got, ref in zip(run(lin), run(tensorwise), strict=True):
        assert torch.equal(got, ref)


class _Dispatched(TorchDispatchMode):
    """A mode that changes nothing but is on the dispatch stack: float8kit then takes every
    op through the dispatcher (its custom ops, the float8 tensor's mm), as it did before its
    eager calls went direct (``versions.eager_direct``). Counts the ops it sees."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", recipes())
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_eager_direct_calls_are_bitwise_the_dispatched_ones(recipe, autocast):
    # eager, float8kit calls its ops' kernels without the dispatcher's round trips: the same
    # bits as through it (under autocast too, where the float8 operands' mm is autocast's)
    results = []
    for mode in (contextlib.nullcontext(), _Dispatched()):
        torch.manual_seed(0)
        hp, f8 = layer(recipe, dtype=torch.float32 if autocast else torch.bfloat16, k=64, n=32)
        x = torch.randn(16, 64, dtype=f8.weight.dtype, requires_grad=True)
        with mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = f8(x)
            out.float().square().sum().backward()
        results.append((out, x.grad, f8.weight.grad))
        if isinstance(mode, _Dispatched):  # the gemms went through the float8 tensor's mm
            assert mode.ops.count(torch.ops.aten.mm.default) == 3
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------- eager, direct


def _direct_runs(monkeypatch, direct: bool) -> list:
    """Switch the direct path (``linear._direct_call``) on as it decides, or off; returns the
    list each direct forward appends to (so a test sees that the path it compares ran)."""
    import float8kit.linear as linear_mod

    ran, decide, forward = [], linear_mod._direct_call, linear_mod._direct_forward

    def spy(ctx, *args):
        ran.append(args[0].shape)
        return forward(ctx, *args)

    monkeypatch.setattr(linear_mod, "_direct_call", decide if direct else lambda *a: False)
    monkeypatch.setattr(linear_mod, "_direct_forward", spy)
    return ran


def _three_readers(recipes_, dtype, k, n, weight_t, frozen):
    """Layers (one per recipe) reading one input, their outputs summed: a shared cast.
    ``weight_t``: weights stored transposed (``nn.Parameter(w.t())``'s strides)."""
    torch.manual_seed(0)
    layers = []
    for recipe in recipes_:
        w = torch.randn(n, k, dtype=dtype) * 0.1
        lin = nn.Linear(k, n, bias=True).to(dtype)
        lin.weight = nn.Parameter(w.t().contiguous().t() if weight_t else w)
        layers.append(Float8Linear.from_float(lin, Float8LinearConfig.from_recipe_name(recipe)))
        layers[-1].weight.requires_grad_(not frozen)
    return layers


@pytest.mark.parametrize(
    "case",
    ["bf16-3d", "fp32-48x40", "fp16", "frozen-weight", "no-input-grad", "weight-transposed",
     "shared-by-three", "shared-with-rowwise", "pow2", "inf", "nan", "zeros"],
)  # fmt: skip
def test_eager_direct_path_is_bitwise_the_general_one(case, monkeypatch):
    # a tensorwise DYNAMIC layer called eagerly on plain tensors runs its ops on the float8
    # data (no float8 tensor per operand): the general path's bits, and the general path
    # runs where it must (here: every other recipe)
    dtype = {"fp32-48x40": torch.float32, "fp16": torch.float16}.get(case, torch.bfloat16)
    k, n = (48, 40) if case == "fp32-48x40" else (64, 32)
    recipes_ = {"shared-by-three": ["tensorwise"] * 3}.get(case, ["tensorwise"])
    if case == "shared-with-rowwise":
        recipes_ = ["tensorwise", "rowwise", "tensorwise"]
    shape = (2, 8, k) if case == "bf16-3d" else (16, k)
    results, direct_calls = [], []
    for direct in (True, False):
        ran = _direct_runs(monkeypatch, direct)
        layers = _three_readers(
            recipes_, dtype, k, n, case == "weight-transposed", case == "frozen-weight"
        )
        if case == "pow2":
            layers = [
                Float8Linear.from_float(
                    nn.Linear(k, n).to(dtype),
                    dataclasses.replace(
                        Float8LinearConfig.from_recipe_name("tensorwise"),
                        round_scales_to_power_of_2=True,
                    ),
                )
            ]
        torch.manual_seed(1)
        x = torch.randn(shape, dtype=dtype) * 3
        if case in ("inf", "nan"):
            x[0, 3] = math.inf if case == "inf" else math.nan
        if case == "zeros":
            x.zero_()
        x.requires_grad_(case != "no-input-grad")
        out = sum(lin(x) for lin in layers)
        out.float().square().sum().backward()
        grads = [p.grad for lin in layers for p in lin.parameters()]
        results.append([out, x.grad, *grads])
        direct_calls.append(len(ran))
    tensorwise = sum(r == "tensorwise" for r in recipes_) if case != "pow2" else 1
    assert direct_calls == [tensorwise, 0]
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    for got, want in zip(*results, strict=True):  # bit for bit, NaNs included
        assert (got is None and want is None) or torch.equal(
            got.detach().view(bits[got.dtype]), want.detach().view(bits[want.dtype])
        )


def test_eager_direct_path_stays_off_where_the_general_one_must_run(monkeypatch):
    # autocast, activation checkpointing's saved-tensor hooks, a torch dispatch mode (a
    # checkpoint policy, fake tensors, the profiler) and torch.compile take the general path
    ran = _direct_runs(monkeypatch, True)
    _, f8 = layer("tensorwise", k=64, n=32)
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    f8(x).sum().backward()
    assert len(ran) == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        f8(x).sum().backward()
    torch.utils.checkpoint.checkpoint(f8, x, use_reentrant=False).sum().backward()
    with _Dispatched():
        f8(x).sum().backward()
    torch.compile(f8)(x).sum().backward()
    assert len(ran) == 1
