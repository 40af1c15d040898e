"""CUDA-only checks (``pytest -m gpu`` on an H100): the cuBLAS float8 kernels, their layout
and alignment rules, and compile on GPU. Skipped on machines without CUDA."""

import copy

import pytest
import torch
from torch import nn

from float8kit import Float8LinearConfig, convert_to_float8_training
from tests.helpers import fwd_bwd, sqnr

pytestmark = pytest.mark.gpu
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


def mlp():
    return nn.Sequential(nn.Linear(1024, 2048), nn.SiLU(), nn.Linear(2048, 1024))


@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_kernel_matches_cpu_reference_and_emulation(recipe):
    base = mlp()
    config = Float8LinearConfig.from_recipe_name(recipe)
    cuda = convert_to_float8_training(copy.deepcopy(base).cuda().bfloat16(), config=config)
    emu = convert_to_float8_training(
        copy.deepcopy(base).cuda().bfloat16(),
        config=Float8LinearConfig(**{**config.__dict__, "emulate": True}),
    )
    x = torch.randn(16, 256, 1024, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(16, 256, 1024, device="cuda")
    ref = fwd_bwd(copy.deepcopy(base).cuda(), x.float(), grad)
    got, emulated = fwd_bwd(cuda, x, grad), fwd_bwd(emu, x, grad)
    assert sqnr(ref[0], got[0]) >= 25 and sqnr(ref[1], got[1]) >= 20
    assert sqnr(ref[2]["0.weight"], got[2]["0.weight"]) >= 20
    assert sqnr(emulated[0], got[0]) >= 35  # same math; fast accumulation differs slightly


@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_agrees_with_torchao(recipe):
    ao = pytest.importorskip("torchao.float8")
    base = mlp().cuda().bfloat16()
    ours = convert_to_float8_training(
        copy.deepcopy(base), config=Float8LinearConfig.from_recipe_name(recipe)
    )
    peer = ao.convert_to_float8_training(
        copy.deepcopy(base), config=ao.Float8LinearConfig.from_recipe_name(recipe)
    )
    x = torch.randn(8, 512, 1024, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(8, 512, 1024, device="cuda")
    a, b = fwd_bwd(ours, x, grad), fwd_bwd(peer, x, grad)
    assert sqnr(b[0], a[0]) >= 30 and sqnr(b[1], a[1]) >= 30
    assert sqnr(b[2]["0.weight"], a[2]["0.weight"]) >= 30


def test_cuda_alignment_error_names_the_fix_and_padding_works():
    odd = nn.Linear(40, 64).cuda().bfloat16()  # K = 40: cuBLAS needs multiples of 16
    x = torch.randn(32, 40, device="cuda", dtype=torch.bfloat16)
    f8 = convert_to_float8_training(copy.deepcopy(odd), module_filter_fn=lambda m, f: True)
    with pytest.raises(ValueError, match="pad_inner_dim"):
        f8(x)
    padded = convert_to_float8_training(
        copy.deepcopy(odd),
        config=Float8LinearConfig(pad_inner_dim=True),
        module_filter_fn=lambda m, f: True,
    )
    assert sqnr(odd(x).float(), padded(x).float()) >= 25


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@torch._inductor.config.patch(emulate_precision_casts=True)
def test_cuda_compile_fullgraph_is_bitwise_eager(recipe):
    # Inductor's Triton kernels keep bf16 intermediates (SiLU, the bias add) in fp32 unless
    # told to round them as eager does; without that the next layer's float8 casts move
    # (35 dB compiled vs eager on an H200). With it, compile changes no bit of float8kit's.
    # (Inductor's config.patch: on torch 2.11 monkeypatch's undo deletes the setting, and
    # every later compile in the process fails.)
    torch._dynamo.reset()
    config = Float8LinearConfig.from_recipe_name(recipe)
    m = convert_to_float8_training(mlp().cuda().bfloat16(), config=config)
    x = torch.randn(8, 256, 1024, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(8, 256, 1024, device="cuda")
    eager = fwd_bwd(m, x, grad)
    compiled = fwd_bwd(torch.compile(m, fullgraph=True), x, grad)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])
    for name, g in eager[2].items():
        assert torch.equal(g, compiled[2][name]), name


def test_cuda_non_finite_amax_warning_is_deferred_not_synced():
    import warnings

    from float8kit import precompute_scales

    m = convert_to_float8_training(
        nn.Linear(64, 64).cuda(), config=Float8LinearConfig.from_recipe_name("delayed")
    )
    x = torch.randn(32, 64, device="cuda")
    x[0, 0] = float("inf")
    m(x).sum().backward()
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        precompute_scales(m)  # the flags are copied to the host asynchronously
    torch.cuda.synchronize()
    m(torch.randn(32, 64, device="cuda")).sum().backward()
    with pytest.warns(UserWarning, match=r"non-finite amax recorded for <root>\.input"):
        precompute_scales(m)  # ... and reported by the next call
    assert not any("non-finite" in str(w.message) for w in first)
    assert torch.isfinite(m.fp8_amax_history_input).all()  # never folded in


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("tokens", [37, 1])
def test_cuda_token_count_not_a_multiple_of_16_in_backward(recipe, tokens):
    # the grad_weight gemm reduces over the tokens: zero-padded, not refused (kernel_plan)
    hp = nn.Linear(64, 128).cuda().bfloat16()
    f8 = convert_to_float8_training(
        copy.deepcopy(hp), config=Float8LinearConfig.from_recipe_name(recipe)
    )
    x = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(tokens, 128, device="cuda")
    ref, got = fwd_bwd(copy.deepcopy(hp).float(), x.float(), grad), fwd_bwd(f8, x, grad)
    assert sqnr(ref[0], got[0]) >= 25 and sqnr(ref[1], got[1]) >= 20
    assert sqnr(ref[2]["weight"], got[2]["weight"]) >= 20


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_cuda_rowwise_fp32_model_and_autocast(recipe):
    # rowwise kernels write bf16 only: an fp32 output / grad_weight is produced as bf16 and
    # upcast; under autocast the fp32 weight goes to float8 directly
    hp = nn.Linear(256, 128).cuda()
    config = Float8LinearConfig.from_recipe_name(recipe)
    f8 = convert_to_float8_training(copy.deepcopy(hp), config=config)
    x, grad = torch.randn(64, 256, device="cuda"), torch.randn(64, 128, device="cuda")
    ref = fwd_bwd(hp, x, grad)
    got = fwd_bwd(f8, x, grad)
    assert got[0].dtype == torch.float32 and got[2]["weight"].dtype == torch.float32
    assert sqnr(ref[0], got[0]) >= 25 and sqnr(ref[2]["weight"], got[2]["weight"]) >= 20
    with torch.autocast("cuda", dtype=torch.bfloat16):
        auto = fwd_bwd(f8, x, grad)
    assert auto[0].dtype == torch.bfloat16 and auto[2]["weight"].dtype == torch.float32
    assert sqnr(ref[0], auto[0]) >= 25 and sqnr(ref[2]["weight"], auto[2]["weight"]) >= 20


@pytest.mark.parametrize("recipe", RECIPES + ["delayed"])
def test_cuda_empty_batch_calls_no_kernel(recipe):
    from tests.helpers import count_scaled_mm

    f8 = convert_to_float8_training(
        nn.Linear(64, 128).cuda().bfloat16(), config=Float8LinearConfig.from_recipe_name(recipe)
    )
    x = torch.randn(0, 64, device="cuda", dtype=torch.bfloat16)
    with count_scaled_mm() as calls:
        out, gx, g = fwd_bwd(f8, x, torch.randn(0, 128, device="cuda"))
    assert not calls and out.shape == (0, 128) and gx.shape == (0, 64)
    assert torch.equal(g["weight"], torch.zeros_like(g["weight"]))


def block_mlp():
    # dims that are multiples of 128 (the blockwise default filter); see tests/test_blockwise
    return nn.Sequential(nn.Linear(1024, 2048), nn.SiLU(), nn.Linear(2048, 1024))


@pytest.mark.parametrize("tokens", [1024, 998])  # 998: padded to whole 128-blocks and to 4s
def test_cuda_blockwise_kernel_matches_emulation_and_fp32(tokens):
    base = block_mlp()
    config = Float8LinearConfig.from_recipe_name("blockwise")
    cuda = convert_to_float8_training(copy.deepcopy(base).cuda().bfloat16(), config=config)
    emu = convert_to_float8_training(
        copy.deepcopy(base).cuda().bfloat16(),
        config=Float8LinearConfig(**{**config.__dict__, "emulate": True}),
    )
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    x[:, [5, 17, 40]] *= 100
    grad = torch.randn(tokens, 1024, device="cuda")
    ref = fwd_bwd(copy.deepcopy(base).cuda(), x.float(), grad)
    got, emulated = fwd_bwd(cuda, x, grad), fwd_bwd(emu, x, grad)

    def gemms(r):
        return r[0], r[1], r[2]["0.weight"]

    for i, (r, g, e) in enumerate(zip(gemms(ref), gemms(got), gemms(emulated), strict=True)):
        assert sqnr(r, g) >= 22, i
        assert sqnr(e, g) >= 35, i  # the kernel is the emulated definition, to bf16 output


def test_cuda_blockwise_agrees_with_torchao_prototype():
    proto = pytest.importorskip("torchao.prototype.blockwise_fp8_training.linear")
    from float8kit import Float8Linear

    torch.manual_seed(0)
    layer = nn.Linear(1024, 2048, bias=False).cuda().bfloat16()
    ours = Float8Linear.from_float(
        copy.deepcopy(layer), config=Float8LinearConfig.from_recipe_name("blockwise")
    )
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    a = fwd_bwd(ours, x, grad)
    xp = x.clone().requires_grad_()
    w = layer.weight.detach().clone().requires_grad_()
    out = proto.fp8_blockwise_mm.apply(xp, w, 128, torch.bfloat16, False)
    out.backward(grad)
    for mine, theirs in ((a[0], out), (a[1], xp.grad), (a[2]["weight"], w.grad)):
        assert sqnr(theirs, mine) >= 30


def test_cuda_scaled_grouped_mm_matches_emulation_and_fp32():
    # MoE experts through torch._scaled_grouped_mm (sm90); groups of 16-multiples, one empty
    from float8kit import Float8ExpertsConfig, convert_experts_to_float8_training

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(4, 256, 512) / 16)
            self.w2 = nn.Parameter(torch.randn(4, 512, 256) / 23)

        def forward(self, x):
            offs = torch.tensor([128, 128, 384, 512], dtype=torch.int32, device=x.device)
            h = torch.nn.functional.silu(torch._grouped_mm(x, self.w1, offs=offs))
            return torch._grouped_mm(h, self.w2, offs=offs)

    base = Experts().cuda()
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(512, 256, device="cuda")
    ref = fwd_bwd(copy.deepcopy(base), x.float(), grad)
    kernel = fwd_bwd(convert_experts_to_float8_training(copy.deepcopy(base).bfloat16()), x, grad)
    emu_config = Float8ExpertsConfig(emulate=True)
    emu_model = convert_experts_to_float8_training(
        copy.deepcopy(base).bfloat16(), config=emu_config
    )
    emu = fwd_bwd(emu_model, x, grad)
    assert sqnr(ref[0], kernel[0]) >= 20 and sqnr(ref[1], kernel[1]) >= 20
    for name in ("w1", "w2"):
        assert sqnr(ref[2][name], kernel[2][name]) >= 20
        assert kernel[2][name][1].abs().max() == 0  # the expert with no tokens
        assert sqnr(emu[2][name], kernel[2][name]) >= 35  # same math, other summation order
    assert sqnr(emu[0], kernel[0]) >= 35


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("guard", [True, False])
@pytest.mark.parametrize("hp_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(4096, 8192), (37, 70), (1, 64), (64, 1), (130, 4100)])
def test_cuda_one_pass_cast_kernel_is_bitwise_the_reference(fp8, guard, hp_dtype, shape):
    """float8kit::cast_tensorwise's Triton kernel against its torch reference run on the same
    GPU: every byte of both layouts (finite values, the saturation at +-fp8_max, inf and NaN
    with their signs) and the amax (NaN when the tensor has one)."""
    from float8kit import cast

    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = (torch.randn(shape, device="cuda", generator=g) * 300).to(hp_dtype)
    flat = x.view(-1)
    flat[:4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e9], device="cuda").to(
        hp_dtype
    )  # (every shape here has at least 64 elements)
    flat[-1] = 2.0**-30  # below float8's subnormals after scaling: rounds to 0
    scale = torch.tensor(0.37, device="cuda")
    got = torch.ops.float8kit.cast_tensorwise(x, scale, fp8, guard, True, True, True)
    want = cast.cast_tensorwise_reference(x, scale, fp8, guard, True, True, True)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
    assert got[2].isnan() and want[2].isnan()  # the NaN planted above reaches the amax
    finite = x.float().nan_to_num(0.0, 0.0, 0.0)
    _, _, amax = torch.ops.float8kit.cast_tensorwise(finite, scale, fp8, guard, False, False, True)
    assert amax.item() == finite.abs().max().item()


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_low_bit_optimizer_on_cuda_is_the_cpu_step_bitwise(name):
    """Correctly rounded elementwise operations on both devices: 3 steps on the mesh test's
    parameters (partial blocks, fp32-state biases) give the CPU's bits on CUDA."""
    from benchmarks.measures import optim as measure

    cpu = measure.one_device(name)
    model = measure._Params(0).cuda()
    opt = measure._opt(name, model)
    for step in range(measure.MESH_STEPS):
        grads = measure.global_grads(step)
        for n, p in model.named_parameters():
            p.grad = grads[n].cuda()
        opt.step()
    for n, p in model.named_parameters():
        got = p.detach().cpu()
        assert torch.equal(got, cpu[n]), (n, int((got != cpu[n]).sum()), got.numel())


def test_low_bit_optimizer_stages_on_cuda_are_the_cpu_stages_bitwise():
    """Each stage of a quantized parameter's step on the same inputs, CPU vs CUDA (fp32 bit
    patterns, codes): a mismatch of the whole step (above) names its operation here. Every
    stage takes the CPU's inputs, so one stage's difference does not spread to the next."""
    from benchmarks.measures import optim as measure
    from float8kit import scaling
    from float8kit.optim import adamw, states

    param, grad = measure._Params(0).a.detach(), measure.global_grads(0)["a"]
    m, v = grad * 0.37, grad * grad * 0.5  # states of an earlier step
    group = dict(betas=(0.9, 0.999), lr=1e-2, weight_decay=0.1, eps=1e-8, maximize=False)
    root_prev = torch.sqrt(v)

    def stages(device: str, cpu: dict | None) -> dict:
        at = lambda t: t.to(device)  # noqa: E731
        out = {
            "divide": states.divide(at(grad), 448.0),
            "mul scalar": at(m) * 0.9,
            "root": adamw.root(at(v)),
            "div": at(m) / (at(root_prev) + 1e-8),
            "square": at(root_prev) ** 2,
        }
        x, m1, v1, root = adamw._adamw(at(param), at(grad), at(m), at(v), group, 3.0)
        out.update({"adamw x": x, "adamw m": m1, "adamw v": v1, "adamw root": root})
        m1, root = (cpu["adamw m"], cpu["adamw root"]) if cpu else (m1, root)
        out["block amax"] = scaling.block_amax(at(m1), (1, 128))
        for codec in (states.E4M3_CODEC, states.E4M3_ROOT, states.E2M1_CODEC, states.ROOT4):
            value = at(m1 if codec in (states.E4M3_CODEC, states.E2M1_CODEC) else root)
            codes, scale = states.quantize(value, codec, 128)
            out[f"{codec.name} codes"], out[f"{codec.name} scales"] = codes, scale
            codes, scale = (cpu[f"{codec.name} {k}"] for k in ("codes", "scales")) if cpu else (
                codes, scale)  # fmt: skip
            out[f"{codec.name} decoded"] = states.dequantize(
                at(codes), at(scale), codec, 128, value.shape[1]
            )
        return {k: t.cpu() for k, t in out.items()}

    cpu = stages("cpu", None)
    cuda = stages("cuda", cpu)
    bits = lambda t: t.view(torch.int32) if t.dtype == torch.float32 else t  # noqa: E731
    differ = {k: int((bits(cpu[k]) != bits(cuda[k])).sum()) for k in cpu}
    assert {k: n for k, n in differ.items() if n} == {}, "elements that differ per stage"


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_low_bit_optimizer_step_copies_nothing_from_the_host(name):
    """After the first step (the lookup tables reach the GPU once), a step reads nothing
    from the host: a copy from pageable host memory would wait for the GPU's queued work."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from benchmarks.measures import optim as measure

    class HostCopies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.copies = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            out = func(*args, **kwargs)
            if any(t.device.type == "cpu" and t.numel() > 1 for t in tensors) and any(
                isinstance(o, torch.Tensor) and o.is_cuda for o in [out] if o is not None
            ):
                self.copies.append(str(func))
            return out

    model = measure._Params(0).cuda()
    opt = measure._opt(name, model)
    for step in range(2):
        grads = measure.global_grads(step)
        for n, p in model.named_parameters():
            p.grad = grads[n].cuda()
        if step == 1:
            with HostCopies() as mode:
                opt.step()
        else:
            opt.step()
    assert mode.copies == []


@pytest.mark.parametrize("tokens", [64, 40])
def test_cuda_eager_direct_path_is_bitwise_the_general_one(tokens, monkeypatch):
    # an eager tensorwise call runs its ops on the float8 data directly where no gemm pads
    # (40 tokens: the grad_weight gemm's K is padded, so the general path runs)
    import float8kit.linear as linear_mod

    ran, forward = [], linear_mod._direct_forward
    decide = linear_mod._direct_call
    monkeypatch.setattr(linear_mod, "_direct_forward", lambda *a: ran.append(1) or forward(*a))
    base = mlp().cuda().bfloat16()
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(tokens, 1024, device="cuda")
    got = []
    for direct in (decide, lambda *a: False):
        monkeypatch.setattr(linear_mod, "_direct_call", direct)
        f8 = convert_to_float8_training(copy.deepcopy(base))
        got.append(fwd_bwd(f8, x, grad))
    assert len(ran) == (2 if tokens % 16 == 0 else 0)
    (out, gx, gw), (out_ref, gx_ref, gw_ref) = got
    assert torch.equal(out, out_ref) and torch.equal(gx, gx_ref)
    assert all(torch.equal(gw[k], gw_ref[k]) for k in gw_ref)
