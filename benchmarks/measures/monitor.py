"""Float8Monitor (numbers/monitor.json): the drift case (a STATIC input scale, then 100x larger
data) without and with the guardrail, and the time of a sampled and an unsampled step."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.measures.refs import sqnr
from float8kit import (
    CastConfig,
    Float8LinearConfig,
    Float8Monitor,
    ScalingType,
    calibrate,
    convert_to_float8_training,
)
from float8kit.linear import Float8Linear

STATIC_INPUT = Float8LinearConfig(cast_config_input=CastConfig(scaling_type=ScalingType.STATIC))
DIM = 64


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, 128)
        self.fc2 = nn.Linear(128, 128)
        self.fc3 = nn.Linear(128, DIM)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def drift_model() -> MLP:
    """fc1 with a STATIC input scale calibrated on unit-scale data; fc2, fc3 dynamic
    tensorwise."""
    model = convert_to_float8_training(MLP())
    model.fc1 = Float8Linear.from_float(model.fc1, config=STATIC_INPUT)
    calibrate(model, [torch.randn(32, DIM) for _ in range(4)])
    return model


def train(model, steps, scale=100.0, monitor=None, batch=64):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    for _ in range(steps):
        x = torch.randn(batch, DIM) * scale
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def drift_case(log_path=None) -> dict:
    """The drift case: fc1's STATIC input scale calibrated on unit-scale data, then 5
    training steps on 100x larger data, sampled every 2 steps. Returns the report of the last
    sampled step without the guardrail, and with ``fallback_below_db=15``: its fallbacks,
    warnings and last report (tools/measure.py publishes these numbers)."""
    torch.manual_seed(0)
    model = drift_model()
    monitor = Float8Monitor(model, every=2, log_path=log_path)
    train(model, 3)
    measured = monitor.report()
    torch.manual_seed(0)
    model = drift_model()
    guarded = Float8Monitor(model, every=2, fallback_below_db=15)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, 5)
    x = torch.randn(16, DIM) * 100
    ref = F.linear(x.double(), model.fc1.weight.double(), model.fc1.bias.double())
    return {
        "report": measured,
        "fallbacks": guarded.fallbacks,
        "warnings": [str(w.message) for w in caught if "Float8Monitor" in str(w.message)],
        "guarded_report": guarded.report(),
        "fc1_independent_db": sqnr(ref, model.fc1(x)),
        "fc1_float8_db": sqnr(ref, Float8Linear.forward(model.fc1, x)),
    }


def monitor_overhead(dim: int = 512, depth: int = 4, tokens: int = 512, repeats: int = 9) -> dict:
    """Median wall time (ms) of one forward+backward of ``depth`` tensorwise float8 linears
    (``dim`` x ``dim``, ``tokens`` rows) without a monitor, and with one on its unsampled
    and sampled steps (tools/measure.py publishes this; tests/test_monitor.py's op count test is the
    exact check that an unsampled step adds nothing)."""
    import statistics
    import time

    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(dim, dim), nn.GELU()]
    model = convert_to_float8_training(nn.Sequential(*layers))
    x = torch.randn(tokens, dim)

    def step() -> float:
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
        return 1e3 * (time.perf_counter() - t0)

    for _ in range(2):
        step()  # warm-up
    times = {"bare_ms": [], "sampled_ms": [], "unsampled_ms": []}
    for _ in range(repeats):  # interleaved, so that a change of machine load hits all three
        times["bare_ms"].append(step())
        monitor = Float8Monitor(model, every=2)
        times["sampled_ms"].append(step())  # step 0
        times["unsampled_ms"].append(step())  # step 1
        monitor.remove()
    return {
        "dim": dim,
        "depth": depth,
        "tokens": tokens,
        "repeats": repeats,
        **{k: statistics.median(v) for k, v in times.items()},
    }
