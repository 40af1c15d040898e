"""torch.compile(fullgraph=True) with DELAYED and STATIC scaling: one graph, no graph break,
one recompile when the first precompute_scales marks the delayed scales set (dropping the
first step's dynamic fallback) and none after it (the grad_output amax recorded in backward
included), the same records as eager, and the stale-scale warning still
fires from inside the compiled graph. One compile (~30-40 s on CPU)."""

import copy
import warnings

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from float8kit import (
    CastConfig,
    Float8Linear,
    Float8LinearConfig,
    ScalingType,
    calibrate,
    precompute_scales,
)

DELAYED = CastConfig(scaling_type=ScalingType.DELAYED, amax_history_len=4)
STATIC = CastConfig(scaling_type=ScalingType.STATIC)


def _model() -> nn.Module:
    torch.manual_seed(0)
    delayed = Float8LinearConfig(
        cast_config_input=DELAYED,
        cast_config_weight=DELAYED,
        cast_config_grad_output=DELAYED,
        stale_delayed_warn_after=3,
    )
    static = Float8LinearConfig(
        cast_config_input=STATIC,
        cast_config_weight=STATIC,
        cast_config_grad_output=CastConfig(scaling_type="static", static_scale=2.0**16),
    )
    return nn.Sequential(
        Float8Linear(32, 64, config=delayed), nn.ReLU(), Float8Linear(64, 16, config=static)
    )


def _step(model, opt, x, target):
    loss = (model(x) - target).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _records(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k.startswith("0.fp8")}


@pytest.mark.slow
def test_compiled_delayed_and_static_match_eager_without_recompiles():
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(64, 32, generator=g), torch.randn(64, 16, generator=g)) for _ in range(5)
    ]
    eager = _model()
    calibrate(eager, [batches[0][0] * 2])
    compiled_copy = copy.deepcopy(eager)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_c = torch.optim.SGD(compiled_copy.parameters(), lr=0.05)

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    backend = CompileCounterWithBackend("inductor")
    compiled = torch.compile(compiled_copy, backend=backend, fullgraph=True)

    losses_e, losses_c = [], []
    for step, (x, target) in enumerate(batches):
        losses_e.append(_step(eager, opt_e, x, target))
        losses_c.append(_step(compiled, opt_c, x, target))
        if step == 0:
            # the first step's amaxes (input and weight in forward, grad_output in backward)
            # are recorded identically by the compiled graph
            rec_e, rec_c = _records(eager), _records(compiled_copy)
            assert float(rec_e["0.fp8_amax_grad_output"]) > 0
            for k in rec_e:
                assert torch.equal(rec_e[k], rec_c[k]), k
        precompute_scales(eager)
        precompute_scales(compiled)
        for k, v in _records(eager).items():
            assert torch.equal(v, _records(compiled_copy)[k]), (step, k)  # same scales, bitwise
        if step == 1:
            # the first precompute_scales marked the delayed scales set (a host flag): one
            # recompile drops the first-step fallback from the graph, and that is all
            frames_after_flag = backend.frame_count

    print("eager losses   ", [f"{v:.5f}" for v in losses_e])
    print("compiled losses", [f"{v:.5f}" for v in losses_c])
    rel = max(abs(lc - le) / abs(le) for le, lc in zip(losses_e, losses_c, strict=True))
    print(f"max relative loss difference compiled vs eager: {rel:.2e}")
    assert torch.equal(torch.tensor(losses_c), torch.tensor(losses_e))  # bitwise (fp32 model)
    assert frames_after_flag == 2
    assert backend.frame_count == 2  # no recompiles across the later steps
    assert dict(dynamo_utils.counters["graph_break"]) == {}

    # forgetting precompute_scales warns from inside the compiled graph, still no recompile
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, target in batches[:4]:
            _step(compiled, opt_c, x, target)
    stale = [w for w in caught if "precompute_scales" in str(w.message)]
    assert len(stale) == 1
    assert backend.frame_count == 2


def test_compiled_precompute_scales_is_one_graph_without_host_reads():
    """Steady state: precompute_scales compiles to one graph (the non-finite warning runs in
    a custom op, not a host read that splits it), and an eager precompute_scales + forward +
    backward reads nothing back to the host."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = _model()[:1]  # the DELAYED layer
    x = torch.randn(64, 32)
    for _ in range(2):
        model(x).sum().backward()
        precompute_scales(model)

    class HostReads(TorchDispatchMode):
        reads: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (
                torch.ops.aten._local_scalar_dense.default,
                torch.ops.aten.lift_fresh.default,
            ):
                HostReads.reads.append(str(func))
            return func(*args, **(kwargs or {}))

    with HostReads():
        precompute_scales(model)
        model(x).sum().backward()
        precompute_scales(model)
    assert HostReads.reads == []

    torch._dynamo.reset()
    explained = torch._dynamo.explain(precompute_scales)(model)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("recipe", ["tensorwise", "static"])
def test_compiled_transposed_operands_match_eager(recipe):
    """A weight made as ``nn.Parameter(w.t())`` and a transposed input (column-major): the
    one-pass cast op's outputs are contiguous whatever its input's strides, as its fake says
    (they kept the input's strides, and inductor's ``assert_size_stride`` crashed)."""
    torch.manual_seed(0)
    cast = CastConfig() if recipe == "tensorwise" else STATIC
    config = Float8LinearConfig(
        cast_config_input=cast, cast_config_weight=cast, cast_config_grad_output=CastConfig()
    )
    eager = Float8Linear(64, 48, bias=False, config=config)
    eager.weight = nn.Parameter(eager.weight.detach().t().contiguous().t())
    if recipe == "static":
        calibrate(eager, [torch.randn(32, 64)])
    compiled_copy = copy.deepcopy(eager)
    assert compiled_copy.weight.stride() == (1, 48)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_copy, fullgraph=True)
    x = torch.randn(64, 32).t()  # (32, 64), column-major
    grad = torch.randn(32, 48)
    outs = []
    for model, layer in ((eager, eager), (compiled, compiled_copy)):
        xi = x.detach().clone().t().contiguous().t().requires_grad_()
        out = model(xi)
        out.backward(grad)
        outs.append((out.detach(), xi.grad, layer.weight.grad))
    for what, e, c in zip(("output", "grad_input", "grad_weight"), *outs, strict=True):
        assert torch.equal(e, c), what
