"""torch.compile(fullgraph=True) with DELAYED and STATIC scaling: one graph, no graph break,
no recompile across steps (including the first step's dynamic fallback and the grad_output
amax recorded in backward), the same records as eager, and the stale-scale warning still
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
        if step == 0:
            for k, v in _records(eager).items():
                assert torch.equal(v, _records(compiled_copy)[k]), k  # same scales, bitwise

    print("eager losses   ", [f"{v:.5f}" for v in losses_e])
    print("compiled losses", [f"{v:.5f}" for v in losses_c])
    assert losses_c == losses_e  # bitwise: same scales, same roundings
    assert backend.frame_count == 1  # one compile for all steps: no recompiles
    assert dict(dynamo_utils.counters["graph_break"]) == {}

    # forgetting precompute_scales warns from inside the compiled graph, still no recompile
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, target in batches[:4]:
            _step(compiled, opt_c, x, target)
    stale = [w for w in caught if "precompute_scales" in str(w.message)]
    assert len(stale) == 1
    assert backend.frame_count == 1
