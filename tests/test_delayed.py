"""DELAYED scaling: amax history semantics, spike behaviour, stale-scale warning, non-finite
amaxes, per-operand mixing, and the state_dict (exact resume, plain checkpoints)."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from float8kit import (
    CastConfig,
    Float8Linear,
    Float8LinearConfig,
    GemmRole,
    ScalingGranularity,
    ScalingType,
    convert_to_float8_training,
    precompute_scales,
)
from float8kit.cast import operand_scale
from tests.helpers import sqnr

DELAYED = CastConfig(scaling_type=ScalingType.DELAYED)
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def delayed_layer(in_f=64, out_f=64, **cast_kwargs) -> Float8Linear:
    cast = CastConfig(scaling_type=ScalingType.DELAYED, **cast_kwargs)
    config = Float8LinearConfig(
        cast_config_input=cast, cast_config_weight=cast, cast_config_grad_output=cast
    )
    return Float8Linear(in_f, out_f, config=config)


def train_step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor | None = None):
    y = layer(x)
    y.backward(torch.ones_like(y) if grad is None else grad)
    return y.detach()


# ---------------------------------------------------------------------------- config


def test_delayed_recipe_and_defaults():
    c = Float8LinearConfig.from_recipe_name("delayed")
    for cast in (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output):
        assert cast.scaling_type is ScalingType.DELAYED
        assert cast.scaling_granularity is ScalingGranularity.TENSORWISE
        assert cast.amax_history_len == 16 and cast.delayed_scale_from == "max"
    assert c.cast_config_grad_output_for_grad_weight == c.cast_config_grad_output


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(scaling_type="delayed", scaling_granularity="axiswise"), "scaling_granularity"),
        (dict(scaling_type="delayed", amax_history_len=0), "amax_history_len"),
        (dict(scaling_type="delayed", delayed_scale_from="mean"), "delayed_scale_from"),
    ],
)
def test_cast_config_rejects(kwargs, field):
    with pytest.raises(ValueError, match=f"CastConfig.{field}="):
        CastConfig(**kwargs)


def test_operand_uses_must_agree():
    with pytest.raises(ValueError, match="cast_config_input_for_grad_weight"):
        Float8LinearConfig(
            cast_config_input=DELAYED,
            cast_config_input_for_grad_weight=CastConfig(
                scaling_type="delayed", amax_history_len=4
            ),
        )
    # a delayed first use with a dynamic second use is fine
    Float8LinearConfig(cast_config_input=DELAYED, cast_config_input_for_grad_weight=CastConfig())


# ---------------------------------------------------------------------------- state


def test_state_dict_keys_and_both_conversion_paths():
    config = Float8LinearConfig(
        cast_config_input=DELAYED, cast_config_grad_output=DELAYED
    )  # weight stays dynamic: no weight buffers
    swapped = nn.Linear(16, 32)
    convert_to_float8_training(swapped, config=config)  # root: in-place class swap
    model = convert_to_float8_training(nn.Sequential(nn.Linear(16, 32)), config=config)
    from_float = model[0]  # Float8Linear.from_float
    assert_expected_inline(
        "\n".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in swapped.state_dict().items()),
        """\
weight (32, 16) torch.float32
bias (32,) torch.float32
fp8_amax_history_input (16,) torch.float32
fp8_amax_input () torch.float32
fp8_scale_input () torch.float32
fp8_amax_history_grad_output (16,) torch.float32
fp8_amax_grad_output () torch.float32
fp8_scale_grad_output () torch.float32""",
    )
    for a, b in zip(swapped.state_dict().items(), from_float.state_dict().items(), strict=True):
        assert a[0] == b[0] and a[1].shape == b[1].shape
        if a[0].startswith("fp8_"):
            assert torch.equal(a[1], b[1]) and a[1].device == b[1].device
    assert float(from_float.fp8_scale_input) == -1.0  # unset: first step scales dynamically


def test_meta_device_init_then_reset_parameters():
    """Deferred init: build on meta, convert, to_empty, reset_parameters -> initial state."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 32))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("delayed"))
    model.to_empty(device="cpu")
    model[0].reset_parameters()
    for name, buf in model.named_buffers():
        assert buf.device.type == "cpu" and torch.all(buf == -1.0), name
    x = torch.randn(8, 32)
    assert sqnr(F.linear(x, model[0].weight, model[0].bias), model(x)) >= 25


def test_first_step_scales_from_own_amax():
    """Before any precompute_scales, a DELAYED cast equals the dynamic one, bitwise."""
    layer = delayed_layer()
    dynamic = Float8Linear.from_float(copy.deepcopy(layer), config=Float8LinearConfig())
    x = torch.randn(32, 64) * 7
    assert torch.equal(layer(x), dynamic(x))
    assert float(layer.fp8_amax_input) == float(x.abs().max())


@pytest.mark.parametrize("scale_from", ["max", "most_recent"])
def test_history_semantics_against_hand_computed_scales(scale_from):
    layer = delayed_layer(32, 16, amax_history_len=3, delayed_scale_from=scale_from)
    x_amaxes = [1.0, 8.0, 2.0, 4.0, 0.5]
    go_amaxes = [0.25, 0.125, 2.0, 1.0, 0.5]
    history: list[float] = []
    go_history: list[float] = []
    for xa, ga in zip(x_amaxes, go_amaxes, strict=True):
        x = torch.rand(8, 32) * 0.5
        x[3, 5] = -xa  # the amax, exactly
        g = torch.rand(8, 16) * 0.1
        g[1, 2] = ga
        train_step(layer, x, g)
        assert float(layer.fp8_amax_input) == xa
        assert float(layer.fp8_amax_grad_output) == ga
        assert float(layer.fp8_amax_weight) == float(layer.weight.detach().abs().max())
        precompute_scales(layer)
        history = [xa] + history[:2]
        go_history = [ga] + go_history[:2]
        want = max(history) if scale_from == "max" else history[0]
        want_go = max(go_history) if scale_from == "max" else go_history[0]
        assert float(layer.fp8_scale_input) == pytest.approx(E4M3_MAX / want, rel=1e-6)
        assert float(layer.fp8_scale_grad_output) == pytest.approx(E5M2_MAX / want_go, rel=1e-6)
        assert layer.fp8_amax_history_input.tolist() == history + [-1.0] * (3 - len(history))
        assert float(layer.fp8_amax_input) == -1.0  # record cleared
    # max over the last three of [.., 2, 4, 0.5] is 4; most recent is 0.5
    assert float(layer.fp8_scale_input) == pytest.approx(
        E4M3_MAX / (4.0 if scale_from == "max" else 0.5)
    )


def test_power_of_2_scales_from_history():
    cast = CastConfig(scaling_type=ScalingType.DELAYED)
    config = Float8LinearConfig(
        cast_config_input=cast,
        cast_config_weight=cast,
        cast_config_grad_output=cast,
        round_scales_to_power_of_2=True,
    )
    layer = Float8Linear(32, 16, config=config)
    x = torch.zeros(4, 32)
    x[0, 0] = 3.0
    train_step(layer, x)
    precompute_scales(layer)
    assert float(layer.fp8_scale_input) == 128.0  # 448 / 3 = 149.3 floored to 2**7


def test_operand_scale_is_the_one_scale_decision():
    """operand_scale with a layer's state: what the gemms and the FSDP2 all-gather use."""
    layer = delayed_layer(32, 16)
    c = layer.config
    cast = c.cast_config_weight
    amax = layer.weight.detach().abs().max()
    scale, record, scale_set = layer.fp8_state.operand(layer, GemmRole.WEIGHT, True)
    assert not scale_set
    got = operand_scale(cast, GemmRole.WEIGHT, c, amax, scale, record, scale_set)
    assert torch.equal(got, E4M3_MAX / amax)  # unset: the dynamic scale
    assert float(layer.fp8_amax_weight) == float(amax)  # recorded (train mode)
    precompute_scales(layer)
    scale, record, scale_set = layer.fp8_state.operand(layer, GemmRole.WEIGHT, True)
    assert scale_set  # marked by precompute_scales (CPU: at once)
    got = operand_scale(cast, GemmRole.WEIGHT, c, amax * 10, scale, record, scale_set)
    assert torch.equal(got, layer.fp8_scale_weight)
    static = Float8LinearConfig(
        cast_config_weight=CastConfig(scaling_type="static", static_scale=3.0),
        cast_config_input=CastConfig(scaling_type="static", static_scale=2.0),
    )
    s_layer = Float8Linear(32, 16, config=static)
    s_scale, _, _ = s_layer.fp8_state.operand(s_layer, GemmRole.WEIGHT, True)
    got = operand_scale(static.cast_config_weight, GemmRole.WEIGHT, static, None, s_scale)
    assert float(got) == 3.0


class _Ops(TorchDispatchMode):
    """Records the aten ops dispatched (each one a kernel launch on a GPU, eager)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _steady_ops(recipe: str, train: bool) -> list[str]:
    """Ops of one bf16 16x64x64 call (fwd+bwd in train mode, fwd in eval) of a layer that has
    trained two steps with precompute_scales (bench_overhead's shape)."""
    torch.manual_seed(0)
    config = Float8LinearConfig.from_recipe_name(recipe)
    layer = Float8Linear(64, 64, bias=False, config=config).bfloat16()
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(16, 64, dtype=torch.bfloat16)
    for _ in range(2):
        layer(x).backward(go)
        precompute_scales(layer)
    layer.train(train)
    # a new batch, as in training: a tensor the layer has cast before would reuse that
    # dynamic cast (float8kit/shared_cast.py) and skip it
    x = x.detach().clone().requires_grad_()
    with _Ops() as counted:
        y = layer(x)
        if train:
            y.backward(go)
    return counted.ops


def test_delayed_steady_state_costs_no_more_ops_than_dynamic():
    dynamic, delayed = _steady_ops("tensorwise", True), _steady_ops("delayed", True)
    print(f"eager aten ops per fwd+bwd: delayed {len(delayed)}, dynamic {len(dynamic)}")
    assert len(delayed) <= len(dynamic)
    # no first-step fallback left in the steady state: no amax -> scale, no where
    assert "aten.where.self" not in delayed[: delayed.index("aten.mm.default")]
    assert "aten.reciprocal.default" not in delayed
    # eval uses the scales only: no amax of any kind
    eval_ops = _steady_ops("delayed", False)
    print(f"eval forward: {len(eval_ops)} ops")
    amax_ops = {"aten.amax.default", "aten.linalg_vector_norm.default", "aten.max.default"}
    assert not amax_ops & set(eval_ops), eval_ops


def test_records_are_max_over_microbatches_and_skip_eval():
    layer = delayed_layer()
    for amax in (3.0, 5.0, 2.0):  # gradient accumulation: three forwards, one step
        x = torch.zeros(4, 64)
        x[0, 0] = amax
        train_step(layer, x)
    layer.eval()
    x = torch.zeros(4, 64)
    x[0, 0] = 100.0
    layer(x)  # eval mode uses the scales, records nothing
    assert float(layer.fp8_amax_input) == 5.0


def test_spike_clipped_by_stale_scale_then_fixed_by_precompute():
    torch.manual_seed(0)
    layer = delayed_layer(64, 64)
    dynamic = Float8Linear.from_float(copy.deepcopy(layer), config=Float8LinearConfig())
    for _ in range(3):
        train_step(layer, torch.randn(128, 64))
        precompute_scales(layer)
    spike = torch.randn(128, 64) * 100
    ref = F.linear(spike, layer.weight, layer.bias).detach()
    stale = train_step(layer, spike)
    sqnr_stale = sqnr(ref, stale)
    sqnr_dynamic = sqnr(ref, dynamic(spike).detach())
    precompute_scales(layer)
    sqnr_fixed = sqnr(ref, train_step(layer, spike))
    print(
        f"spike SQNR dB: delayed stale {sqnr_stale:.1f}, dynamic {sqnr_dynamic:.1f}, "
        f"delayed after precompute {sqnr_fixed:.1f}"
    )
    assert sqnr_dynamic >= 25
    assert sqnr_stale < sqnr_dynamic - 15  # clipped: 100x values saturate at the old range
    assert sqnr_fixed >= 25


def test_mixed_policies_per_operand():
    """input delayed, weight dynamic, grad_output delayed."""
    config = Float8LinearConfig(cast_config_input=DELAYED, cast_config_grad_output=DELAYED)
    layer = Float8Linear(64, 32, config=config)
    assert not hasattr(layer, "fp8_scale_weight")
    ref = nn.Linear(64, 32)
    ref.load_state_dict(layer.state_dict(), strict=False)
    x_amaxes = []
    for _ in range(3):
        x = torch.randn(64, 64) * 3
        g = torch.randn(64, 32)
        xr = x.clone().requires_grad_()
        x = x.clone().requires_grad_()
        y = layer(x)
        y.backward(g)
        yr = ref(xr)
        yr.backward(g)
        assert sqnr(yr, y) >= 25
        # grad_output is e5m2 (2 mantissa bits): ~25 dB
        assert sqnr(xr.grad, x.grad) >= 20 and sqnr(ref.weight.grad, layer.weight.grad) >= 20
        assert float(layer.fp8_amax_grad_output) == float(g.abs().max())
        layer.weight.grad = ref.weight.grad = None
        x_amaxes.append(float(x.detach().abs().max()))
        precompute_scales(layer)
        assert float(layer.fp8_scale_input) == pytest.approx(E4M3_MAX / max(x_amaxes), rel=1e-6)


def test_layer_used_twice_before_backward():
    """Weight tying: two forwards, then backward through both (records, no version error)."""
    layer = delayed_layer(32, 32)
    x = torch.randn(16, 32)
    inner = layer(x) * 10
    inner_grads = []
    inner.register_hook(inner_grads.append)
    layer(inner).sum().backward()
    assert float(layer.fp8_amax_input) == max(
        float(x.abs().max()), float(inner.detach().abs().max())
    )
    # the outer call's grad_output is all ones; the inner one's is 10x the outer grad_input
    inner_go = 10 * inner_grads[0]
    assert float(layer.fp8_amax_grad_output) == max(1.0, float(inner_go.abs().max()))


# ---------------------------------------------------------------------------- stale scales


def test_forgetting_precompute_warns_once():
    config = Float8LinearConfig.from_recipe_name("delayed")
    config = Float8LinearConfig(
        **{**config.__dict__, "stale_delayed_warn_after": 3}  # type: ignore[arg-type]
    )
    layer = Float8Linear(32, 32, config=config)
    x = torch.randn(8, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            train_step(layer, x)
        assert not caught  # gradient accumulation over 3 micro-batches is fine
        for _ in range(4):
            train_step(layer, x)
        stale = [w for w in caught if "precompute_scales" in str(w.message)]
        assert len(stale) == 1, [str(w.message) for w in caught]
        caught.clear()
        precompute_scales(layer)
        for _ in range(3):
            train_step(layer, x)
        layer.eval()
        for _ in range(5):
            layer(x)  # eval forwards do not count
        assert not caught


# ---------------------------------------------------------------------------- inf / NaN


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_amax_visible_and_not_folded_into_history(bad):
    layer = delayed_layer(64, 64)
    for _ in range(2):
        train_step(layer, torch.randn(32, 64))
        precompute_scales(layer)
    history = layer.fp8_amax_history_input.clone()
    scale = layer.fp8_scale_input.clone()
    x = torch.randn(32, 64)
    x[4, 7] = bad
    y = train_step(layer, x)
    assert not torch.isfinite(y).all()  # never saturated away
    with pytest.warns(UserWarning, match=r"non-finite amax recorded for <root>\.input"):
        precompute_scales(layer)
    assert torch.equal(layer.fp8_amax_history_input, history)  # not poisoned
    assert torch.equal(layer.fp8_scale_input, scale)
    x = torch.randn(32, 64)
    y = train_step(layer, x)
    assert sqnr(F.linear(x, layer.weight, layer.bias), y) >= 25


# ---------------------------------------------------------------------------- checkpoints


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("delayed"))


def _step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_exact_resume_from_checkpoint(tmp_path):
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 32, generator=g) * (1 + i % 3) for i in range(6)]

    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_losses = []
    for x in batches:
        ref_losses.append(_step(model, opt, x))
        precompute_scales(model)

    model1 = _model(0)
    opt1 = torch.optim.AdamW(model1.parameters(), lr=1e-2)
    for i, x in enumerate(batches[:3]):
        _step(model1, opt1, x)
        if i < 2:
            precompute_scales(model1)
    # checkpoint between optimizer.step() and precompute_scales: pending records included
    torch.save({"model": model1.state_dict(), "opt": opt1.state_dict()}, tmp_path / "ckpt.pt")

    model2 = _model(123)  # different init: everything must come from the checkpoint
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    precompute_scales(model2)
    losses = []
    for x in batches[3:]:
        losses.append(_step(model2, opt2, x))
        precompute_scales(model2)
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses[3:]))
    for (k, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_plain_linear_checkpoint_loads_into_delayed_model(tmp_path):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    torch.save(plain.state_dict(), tmp_path / "plain.pt")
    model = _model(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, torch.randn(16, 32))
    precompute_scales(model)  # float8 state is now non-initial
    result = model.load_state_dict(torch.load(tmp_path / "plain.pt", weights_only=True))
    assert not result.missing_keys and not result.unexpected_keys
    for name, buf in model.named_buffers():
        assert torch.all(buf == -1.0), name  # reset to initial: scale from own amax again
    fresh = convert_to_float8_training(
        copy.deepcopy(plain), config=Float8LinearConfig.from_recipe_name("delayed")
    )
    x = torch.randn(16, 32)
    assert torch.equal(model(x), fresh(x))


def test_partial_float8_state_is_reported_missing():
    model = _model(0)
    sd = model.state_dict()
    del sd["0.fp8_scale_input"]
    with pytest.raises(RuntimeError, match="fp8_scale_input"):
        model.load_state_dict(sd)


# ---------------------------------------------------------------------------- tied states


def _fan_out_steps(layers, inputs_per_step, share: bool, mode: str = "freed"):
    """One SGD-free step per entry of ``inputs_per_step`` (a function of the step giving each
    layer's input scale: q, k, v read ``x * s`` for their ``s``, layers with equal ``s``
    the same tensor) with precompute_scales after each: outputs, input grads and the float8
    state per step, and after each update which layers are tied (the index of the first
    layer of each one's tie, or None). ``share=False``: no shared casts, so no ties (the
    per-layer reference)."""
    from float8kit import shared_cast

    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    out = []
    with pytest.MonkeyPatch.context() as m:
        if not share:
            m.setattr(shared_cast, "source_for", lambda t: None)
        for step, scales in enumerate(inputs_per_step):
            xi = x.clone().requires_grad_()
            ys, kept = [], {}
            for layer, s in zip(layers, scales, strict=True):
                # one tensor per distinct scale; "freed": a tensor is dropped as soon as its
                # layer has read it, unless the next layer reads it too
                if s not in kept:
                    kept = {s: xi * s} if mode == "freed" else {**kept, s: xi * s}
                if mode == "no_grad" and step > 0 and s != scales[1]:
                    with torch.no_grad():
                        layer(kept[s])
                    continue
                ys.append(layer(kept[s]))
            sum(y.float().square().sum() for y in ys).backward()
            states = [
                {k: v.clone() for k, v in lin.state_dict().items() if "fp8" in k} for lin in layers
            ]
            precompute_scales(nn.ModuleList(layers))
            ties = [lin.fp8_state.tie for lin in layers]
            groups = [None if t is None else ties.index(t) for t in ties]
            out.append(([y.detach() for y in ys], xi.grad, states, groups))
    return out


@pytest.mark.parametrize("mode", ["freed", "alive", "no_grad"])
def test_tied_layers_that_read_different_tensors_keep_their_own_scales(mode):
    """q/k/v tie at step 0 (one tensor, equal states); from step 1 q reads its input x100
    (freed before k reads, or still alive, or under no_grad) while k/v read the old one, and
    at step 4 all read one tensor again. Every layer's outputs, grads and float8 state are
    bitwise those of per-layer state (no ties) at every step, and each layer's input scale is
    the one its own inputs give: k's from k's amax, never q's."""
    config = Float8LinearConfig.from_recipe_name("delayed")
    torch.manual_seed(0)
    layers = [Float8Linear(64, 64, config=config) for _ in range(3)]
    ref_layers = copy.deepcopy(layers)
    steps = [(1, 1, 1), (100, 1, 1), (100, 1, 1), (1, 100, 1), (1, 1, 1)]
    got = _fan_out_steps(layers, steps, share=True, mode=mode)
    want = _fan_out_steps(ref_layers, steps, share=False, mode=mode)
    for (gy, gx, gs, _), (wy, wx, ws, _) in zip(got, want, strict=True):
        for a, b in zip(gy, wy, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(gx, wx)
        for a, b in zip(gs, ws, strict=True):
            for k in a:
                assert torch.equal(a[k], b[k]), k
    # by hand: after step 2, q's history holds amax(100 x), k's and v's amax(x) only
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    q_state, k_state = got[2][2][0], got[2][2][1]
    assert float(k_state["fp8_scale_input"]) == pytest.approx(E4M3_MAX / float(x.abs().max()))
    assert float(q_state["fp8_scale_input"]) == pytest.approx(
        E4M3_MAX / float((100 * x).abs().max())
    )
    # a tie keeps only the layers that read the same tensors: all three after step 0, k and
    # v after steps 1 and 2, none after step 3; their amax histories then differ, so they do
    # not tie again at step 4 (they would, once equal again)
    assert [g[3] for g in got] == [[0, 0, 0], [None, 1, 1], [None, 1, 1], [None] * 3, [None] * 3]


class _Untracked(torch.Tensor):
    """An input the shared-cast cache does not key on (a tensor subclass), like every input
    of a compiled forward: a tied layer's read of it is not known to its tie."""


def test_tie_ends_after_untracked_reads():
    """q/k/v tie at step 0; at step 1 they read tensors the tie cannot see (q's x100): their
    recording forwards are not all accounted for, so the tie ends at the update, and at step 2
    (one plain tensor again) k and v do not reuse q's cast, whose scale is no longer theirs."""
    config = Float8LinearConfig.from_recipe_name("delayed")
    torch.manual_seed(0)
    layers = [Float8Linear(64, 64, config=config) for _ in range(3)]
    ref_layers = copy.deepcopy(layers)
    x = torch.randn(128, 64)
    for lins in (layers, ref_layers):
        for step, scales in enumerate(((1, 1, 1), (100, 1, 1), (1, 1, 1))):
            one = x.clone().requires_grad_()
            for lin, s in zip(lins, scales, strict=True):
                h = one if s == 1 else one * s
                if step == 1:
                    h = h.as_subclass(_Untracked)
                if lins is ref_layers:
                    h = h.clone()  # one tensor per layer: never shared, never tied
                lin(h).sum().backward()
            if step == 0 and lins is layers:
                assert layers[0].fp8_state.tie is layers[2].fp8_state.tie is not None
            precompute_scales(nn.ModuleList(lins))
        assert all(lin.fp8_state.tie is None for lin in lins)
    y, y_ref = [lin(x) for lin in layers], [lin(x) for lin in ref_layers]
    for a, b in zip(y, y_ref, strict=True):
        assert torch.equal(a, b)
