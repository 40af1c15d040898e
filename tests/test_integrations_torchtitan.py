"""float8kit.integrations.torchtitan with torchtitan 0.3's own config tree, modules, meta
build + init_states, OptimizersContainer and config registry loader (CPU; its Trainer needs
a GPU and is not run here)."""

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "torchtitan", reason="torchtitan not installed (make setup installs it: see the Makefile)"
)

import torch.nn.functional as F  # noqa: E402
from helpers import fwd_bwd, sqnr  # noqa: E402
from torchtitan.components.optimizer import default_adamw  # noqa: E402
from torchtitan.models.common.feed_forward import FeedForward  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.nn_modules import RMSNorm  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402
from torchtitan.protocols.model import BaseModel  # noqa: E402
from torchtitan.protocols.model_spec import ModelSpec  # noqa: E402
from torchtitan.protocols.module import ModuleList  # noqa: E402

from float8kit import (  # noqa: E402
    CastConfig,
    Float8Linear,
    Float8LinearConfig,
    ScalingType,
    convert_to_float8_training,
    default_module_filter,
    precompute_scales,
)
from float8kit import state as float8_state  # noqa: E402
from float8kit.integrations.torchtitan import (  # noqa: E402
    Float8KitConverter,
    Float8KitLinear,
    llama3_debugmodel_float8kit,
    with_precompute,
)

DIM, HIDDEN, OUT = 64, 128, 32

_INIT = {
    "weight": lambda p: torch.nn.init.trunc_normal_(p, std=0.02),
    "bias": torch.nn.init.zeros_,
}


class TinyMLP(BaseModel):
    """Attention-free, from torchtitan's modules: ``n`` pre-norm SwiGLU blocks, an hp head."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        norms: list
        layers: list
        lm_head: Linear.Config

        def update_from_config(self, *, config, **kwargs) -> None:
            pass

        def get_nparams_and_flops(self, model, seq_len):
            return sum(p.numel() for p in model.parameters()), 0

    def __init__(self, config: Config):
        super().__init__()
        self.norms = ModuleList([c.build() for c in config.norms])
        self.layers = ModuleList([c.build() for c in config.layers])
        self.lm_head = config.lm_head.build()

    def forward(self, x):
        for norm, ffn in zip(self.norms, self.layers, strict=True):
            x = x + ffn(norm(x))
        return self.lm_head(x)


def tiny_config(n: int = 2) -> TinyMLP.Config:
    def linear(i, o):
        return Linear.Config(in_features=i, out_features=o, param_init=_INIT)

    return TinyMLP.Config(
        norms=[
            RMSNorm.Config(normalized_shape=DIM, param_init={"weight": torch.nn.init.ones_})
            for _ in range(n)
        ],
        layers=[
            FeedForward.Config(
                w1=linear(DIM, HIDDEN), w2=linear(HIDDEN, DIM), w3=linear(DIM, HIDDEN)
            )
            for _ in range(n)
        ],
        lm_head=linear(DIM, OUT),
    )


def build(config, meta: bool = False, seed: int = 0):
    """torchtitan's way (meta build, ``to_empty``, ``init_states``) or straight on the CPU."""
    with torch.device("meta") if meta else torch.device("cpu"):
        model = config.build()
    model.verify_module_protocol()
    if meta:
        model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_states()
    return model


def converted(config, **kw):
    return Float8KitConverter.Config(**kw).build().convert(copy.deepcopy(config))


def not_head(mod, fqn):
    return "lm_head" not in fqn and default_module_filter(mod, fqn)


STATIC = Float8LinearConfig(
    cast_config_input=CastConfig(scaling_type=ScalingType.STATIC, static_scale=8.0),
    cast_config_weight=CastConfig(scaling_type=ScalingType.DELAYED),
)

# ---------------------------------------------------------------------------- conversion


def test_converter_rewrites_llama3_config():
    spec = model_registry("debugmodel", converters=[Float8KitConverter.Config()])
    plain = model_registry("debugmodel")
    got = {fqn: type(c) for fqn, c, _, _ in spec.model.traverse(Linear.Config)}
    before = {fqn: c for fqn, c, _, _ in plain.model.traverse(Linear.Config)}
    assert got.keys() == before.keys() and len(got) == 31  # 6 layers x 5 + lm_head
    assert got.pop("lm_head") is Linear.Config  # the head stays hp by default
    assert set(got.values()) == {Float8KitLinear.Config}
    for fqn, cfg, _, _ in spec.model.traverse(Linear.Config):
        ref = before[fqn]
        assert (cfg.in_features, cfg.out_features, cfg.bias) == (
            ref.in_features,
            ref.out_features,
            ref.bias,
        )
        assert cfg.param_init.keys() == ref.param_init.keys()
        if fqn != "lm_head":
            assert cfg.float8 == Float8LinearConfig.from_recipe_name("tensorwise")
    # the built model holds float8kit layers where the config says so
    with torch.device("meta"):
        model = spec.model.build()
    kinds = {fqn: type(m) for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds.pop("lm_head") is Linear
    assert len(kinds) == 30 and set(kinds.values()) == {Float8KitLinear}
    assert all(isinstance(m, Float8Linear) for m in model.modules() if type(m) is Float8KitLinear)
    # torchtitan json-dumps the job config
    json.dumps(llama3_debugmodel_float8kit().to_dict())


def test_converter_filters_and_refuses_a_second_config():
    cfg = tiny_config()
    cfg.layers[0].w1 = Linear.Config(in_features=DIM, out_features=HIDDEN - 8, param_init=_INIT)
    cfg.layers[0].w2 = Linear.Config(in_features=HIDDEN - 8, out_features=DIM, param_init=_INIT)
    cfg.layers[0].w3 = Linear.Config(in_features=DIM, out_features=HIDDEN - 8, param_init=_INIT)
    conv = Float8KitConverter.Config(filter_fqns=["lm_head", "w3"]).build()
    out = conv.convert(cfg)
    # layer 0's dims are not multiples of 16; w3 and the head are filtered by name
    assert conv.converted == ["layers.1.w1", "layers.1.w2"]
    assert type(out.layers[1].w3) is Linear.Config and type(out.layers[0].w1) is Linear.Config
    # converting again with the same config changes nothing
    again = Float8KitConverter.Config(filter_fqns=["lm_head", "w3"]).build()
    assert again.convert(out) is out and again.converted == conv.converted
    with pytest.raises(ValueError, match="already a Float8KitLinear with another float8"):
        Float8KitConverter.Config(recipe_name="rowwise").build().convert(out)
    with pytest.raises(ValueError, match="unknown float8 recipe 'fp8'"):
        Float8KitConverter.Config(recipe_name="fp8").build()


# ---------------------------------------------------------------------------- meta build + init


# the float8 buffers per layer: DELAYED 3 per operand, STATIC 1; a float8 all-gather weight
# (a wrapper parameter that param_init initializes through) keeps none
META_CASES = {
    "delayed": (Float8LinearConfig.from_recipe_name("delayed"), 9),
    "static_input": (STATIC, 4),
    "fsdp_float8_all_gather": (
        dataclasses.replace(Float8LinearConfig(), enable_fsdp_float8_all_gather=True),
        0,
    ),
}


@pytest.mark.parametrize("case", META_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_build_init_states_equals_a_real_build(case, dtype):
    float8, per_layer = META_CASES[case]
    cfg = converted(tiny_config(), float8=float8)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # torchtitan builds under training.dtype
    try:
        meta, real = build(cfg, meta=True), build(cfg)
    finally:
        torch.set_default_dtype(default)
    # what init_states writes, not to_empty's reset: spoil the buffers, initialize again
    for b in meta.buffers():
        b.fill_(float("nan"))
    torch.manual_seed(0)
    meta.init_states()
    meta_state, real_state = meta.state_dict(), real.state_dict()
    assert meta_state.keys() == real_state.keys()
    buffers = [n for n in meta_state if ".fp8_" in n]
    assert len(buffers) == 6 * per_layer  # 6 float8 layers
    for name, value in meta_state.items():
        assert torch.equal(value, real_state[name]), name
        assert torch.isfinite(value).all(), name
    for name in buffers:  # fp32 state, whatever the default dtype at build time
        assert meta_state[name].dtype == real_state[name].dtype == torch.float32, name
    if float8 is STATIC:
        assert meta_state["layers.0.w1.fp8_scale_input"].item() == 8.0
    if float8.enable_fsdp_float8_all_gather:  # param_init went through the wrapper
        assert type(meta.layers[0].w1.weight).__name__ == "Float8AllGatherWeight"
    # a delayed layer starts unset, as a plain Float8Linear does
    ref = Float8Linear(DIM, HIDDEN, config=float8)
    for name, value in ref.state_dict().items():
        if name.startswith("fp8_"):
            assert torch.equal(meta_state[f"layers.0.w1.{name}"], value), name


def test_init_states_puts_the_scale_state_on_buffer_device():
    # torchtitan's CPU offload: parameters on the CPU, buffers where the compute runs (meta
    # here stands in for that other device: the one every machine has)
    model = build(converted(tiny_config(), recipe_name="delayed"))
    model.init_states(buffer_device=torch.device("meta"))
    fp8 = {n: b for n, b in model.named_buffers() if ".fp8_" in n}
    assert len(fp8) == 6 * 9 and all(b.is_meta and b.dtype == torch.float32 for b in fp8.values())
    assert not any(p.is_meta for p in model.parameters())


@pytest.fixture
def one_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["partial_dtensor", "spmd_types"])
def test_parallelize_declares_the_scale_state(one_rank, backend):
    # torchtitan's decoders give every Linear a sharding_config naming its weight only
    # (set_decoder_sharding_config); Module.parallelize refuses a buffer it does not name
    import spmd_types as spmd
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.common.decoder_sharding import dense_param_placement
    from torchtitan.protocols.sharding import ShardingConfig

    cfg = tiny_config()
    shared = ShardingConfig(state_shardings={"weight": dense_param_placement(tp=spmd.S(0))})
    for _, linear, _, _ in cfg.traverse(Linear.Config):
        linear.sharding_config = shared  # one object for every layer, as torchtitan may
    model = build(converted(cfg, recipe_name="delayed"), meta=True)
    plain = copy.deepcopy(model)
    dims = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    model.parallelize(ParallelDims(**dims, spmd_backend=backend))
    assert set(shared.state_shardings) == {"weight"}  # the shared config is left as it was
    layer = model.layers[0].w1
    names = float8_state.buffer_names(layer.config)
    assert len(names) == 9 and set(layer._sharding_config.state_shardings) == {"weight", *names}
    x = torch.randn(4, 16, DIM, generator=torch.Generator().manual_seed(3))
    grad = torch.randn(4, 16, OUT, generator=torch.Generator().manual_seed(4))
    a, b = fwd_bwd(model, x, grad), fwd_bwd(plain, x, grad)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for name, value in model.state_dict().items():
        assert torch.equal(value, plain.state_dict()[name]), name


# ---------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_forward_backward_is_convert_to_float8_training_and_close_to_hp(recipe):
    base = build(tiny_config())
    ours = build(converted(tiny_config(), recipe_name=recipe), meta=True)
    ours.load_state_dict(base.state_dict(), strict=False)
    float8 = Float8LinearConfig.from_recipe_name(recipe)
    theirs = convert_to_float8_training(
        copy.deepcopy(base), config=float8, module_filter_fn=not_head
    )
    assert [n for n, m in ours.named_modules() if isinstance(m, Float8Linear)] == [
        n for n, m in theirs.named_modules() if isinstance(m, Float8Linear)
    ]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, DIM, generator=g)
    grad = torch.randn(4, 16, OUT, generator=g)
    ref = fwd_bwd(base, x, grad)
    for _ in range(2):  # delayed: the first step scales from the current amax, the second not
        a, b = fwd_bwd(ours, x, grad), fwd_bwd(theirs, x, grad)
        precompute_scales(ours)
        precompute_scales(theirs)
    # bitwise float8kit's own conversion: outputs, input grads, every parameter grad
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        assert torch.equal(a[2][name], b[2][name]), name
    # and close to the unconverted (fp32) model. Its output and input grad are mostly the
    # residual stream and the hp head; each block's float8 branch (three float8 gemms) and the
    # weight grads (e5m2 grad_output) carry the float8 error.
    assert sqnr(ref[0], a[0]) > 40, sqnr(ref[0], a[0])
    assert sqnr(ref[1], a[1]) > 40, sqnr(ref[1], a[1])
    with torch.no_grad():
        for i in range(2):
            branch = sqnr(base.layers[i](base.norms[i](x)), ours.layers[i](ours.norms[i](x)))
            assert branch > 20, (i, branch)
    for name in a[2]:
        if name.startswith("layers."):  # the float8 layers
            assert sqnr(ref[2][name], a[2][name]) > 18, (name, sqnr(ref[2][name], a[2][name]))


# ---------------------------------------------------------------------------- post-optimizer hook


def _spec(model_config, previous=None) -> ModelSpec:
    return ModelSpec(
        name="tiny",
        flavor="mlp",
        model=model_config,
        parallelize_fn=lambda model, **kw: model,
        pipelining_fn=None,
        post_optimizer_build_fn=previous,
        state_dict_adapter=None,
    )


def _optimizers(model):
    cfg = default_adamw(lr=1e-2)
    cfg.implementation = "for-loop"
    return cfg.build(model_parts=[model])


def test_precompute_scales_runs_once_after_each_optimizer_step():
    earlier = []
    spec = with_precompute(
        _spec(
            converted(tiny_config(), recipe_name="delayed"),
            previous=lambda *args: earlier.append(args),
        )
    )
    assert with_precompute(spec) is spec  # idempotent: one hook, not two
    model = build(spec.model, meta=True)
    twin = copy.deepcopy(model)  # the same steps, precompute_scales called by hand
    optimizers, twin_optimizers = _optimizers(model), _optimizers(twin)
    spec.post_optimizer_build_fn(optimizers, [model], None)  # what torchtitan's Trainer does
    assert len(earlier) == 1 and earlier[0][0] is optimizers  # the model's own hook kept
    hook = spec.post_optimizer_build_fn.hook

    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 16, DIM, generator=g), torch.randn(4, 16, OUT, generator=g)
    scale = "layers.0.w1.fp8_scale_input"
    losses = ([], [])
    for step in range(1, 4):
        for m, opt, out in ((model, optimizers, losses[0]), (twin, twin_optimizers, losses[1])):
            opt.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            out.append(loss.item())
        before = model.state_dict()[scale].clone()
        optimizers.step()
        twin_optimizers.step()
        assert hook.calls == step  # exactly once per step
        precompute_scales(twin)
        # the hook folded this step's amaxes into the scales, as precompute_scales does
        assert not torch.equal(model.state_dict()[scale], before)
        for name, value in model.state_dict().items():
            assert torch.equal(value, twin.state_dict()[name]), (step, name)
    assert losses[0] == losses[1]
    assert losses[0][-1] < losses[0][0]
    optimizers.zero_grad()
    assert hook.calls == 3  # zero_grad is no step


# ---------------------------------------------------------------------------- config registry


def test_config_registry_entry_loads_through_torchtitans_config_manager():
    from torchtitan.config.manager import ConfigManager

    config = ConfigManager().parse_args(
        [
            "--module",
            "float8kit.integrations.torchtitan",
            "--config",
            "llama3_debugmodel_float8kit",
            "--training.steps",
            "7",
        ]
    )
    assert config.training.steps == 7
    spec = config.model_spec
    assert getattr(spec.post_optimizer_build_fn, "float8kit_precompute", False)
    kinds = [type(c) for _, c, _, _ in spec.model.traverse(Linear.Config)]
    assert kinds.count(Float8KitLinear.Config) == 30 and kinds.count(Linear.Config) == 1


def test_importing_float8kit_imports_no_torchtitan():
    code = "import sys, float8kit; print('torchtitan' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_tensor_parallel_through_torchtitans_parallelize_two_ranks(tmp_path):
    # tests/torchtitan_tp.py: w1/w3 colwise, w2 rowwise, by torchtitan's own sharding
    # helpers and Module.parallelize, on 2 gloo ranks; against the same model on one process
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + ["tests/torchtitan_tp.py"],
        cwd=repo,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(repo),
            "FLOAT8KIT_RESULTS": str(tmp_path),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for recipe in ("tensorwise", "delayed"):
            x = result[recipe]
            assert x["weights"] == [
                ["DTensor", ["S(0)"]],
                ["DTensor", ["S(1)"]],
                ["DTensor", ["S(0)"]],
            ]
            # the same float8 math: only the rowwise gemm's split sum rounds differently
            assert min(x["out_vs_one_process"]) > 100, x["out_vs_one_process"]
            assert min(x["grad_input_vs_one_process"]) > 100, x["grad_input_vs_one_process"]
            # and float8 it is: as far from hp as float8 goes
            assert 18 < min(x["out_vs_hp"]) and max(x["out_vs_hp"]) < 35, x["out_vs_hp"]
        # the delayed scale state is replicated DTensors, updated by precompute_scales to
        # exactly the one-process scales after each step
        assert result["delayed"]["buffers"] == ["DTensor"]
        assert result["delayed"]["scales_equal"] == [True, True, True]
