"""float8kit.roofline (predicted speedup, calibration, auto filter) and the kernel-traffic
count of benchmarks/bench_traffic.py, on hand-computed cases."""

import json
import math
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

import float8kit
from float8kit import roofline

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_traffic  # noqa: E402

# ----------------------------------------------------------------------------
# the count


class _Stop(Exception):
    """Raised in place of inductor's code generation: the count is taken before it, and
    the C++ compile after it is what makes a CPU compile slow."""


def _stopped(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, _Stop):
            return True
        e = e.__cause__ or e.__context__
    return False


def _count(fn, *args):
    from torch._inductor import scheduler

    def stop(self):
        raise _Stop

    torch._dynamo.reset()
    with (
        mock.patch.object(scheduler.Scheduler, "codegen", stop),
        bench_traffic.record_kernels() as graphs,
        torch._inductor.config.patch(force_disable_caches=True),
    ):
        try:
            torch.compile(fn, fullgraph=True)(*args)
        except Exception as e:  # noqa: BLE001  (inductor wraps what the backend raised)
            if not _stopped(e):
                raise
    torch._dynamo.reset()
    return graphs


@pytest.mark.slow
def test_count_one_elementwise_kernel_and_one_reduction():
    # (x * scale) -> e4m3: one kernel reading 2 B and writing 1 B per element, plus the
    # scalar scale (4 B fp32); amax: one reduction reading 2 B per element, writing one bf16
    x = torch.randn(64, 96, dtype=torch.bfloat16)
    scale = torch.tensor(3.0)
    graphs = _count(lambda x, s: (x.float() * s).to(torch.float8_e4m3fn), x, scale)
    assert len(graphs) == 1 and len(graphs[0]) == 1
    (kernel,) = graphs[0]
    assert kernel["kind"] == "generated" and not kernel["gemm"]
    assert kernel["bytes"] == 64 * 96 * (2 + 1) + 4
    assert kernel["by_numel"] == {64 * 96: 64 * 96 * 3, 1: 4}
    s = bench_traffic.summarize(graphs, 64, 96, 1)
    assert (s["bytes"], s["kernels"], s["gemms"]) == (64 * 96 * 3 + 4, 1, 0)

    (red,) = _count(lambda x: x.abs().amax(), x)[0]
    assert red["bytes"] == 64 * 96 * 2 + 2


@pytest.mark.slow
def test_count_keeps_gemms_apart():
    a = torch.randn(32, 48, dtype=torch.bfloat16)
    b = torch.randn(48, 16, dtype=torch.bfloat16)
    graphs = _count(lambda a, b: torch.mm(a, b) * 2, a, b)
    s = bench_traffic.summarize(graphs, 32, 48, 16)
    # the gemm reads A and B and writes C (bf16); the epilogue reads C and writes 2*C
    assert s["gemms"] == 1 and s["gemm_bytes"] == 2 * (32 * 48 + 48 * 16 + 32 * 16)
    assert s["kernels"] == 1 and s["bytes"] == 2 * 2 * 32 * 16
    assert s["per_element"] == {"input": 0.0, "weight": 0.0, "grad_output": 4.0}


def test_minimum_bytes_per_recipe():
    m, k, n = 2, 3, 5
    e = m * k + k * n + m * n
    assert bench_traffic.minimum_bytes("tensorwise", m, k, n) == 6 * e
    assert bench_traffic.minimum_bytes("delayed", m, k, n) == 4 * e
    assert bench_traffic.minimum_bytes("bf16", m, k, n) == 0
    with pytest.raises(ValueError, match="no minimum defined for recipe 'nope'"):
        bench_traffic.minimum_bytes("nope", m, k, n)


# ----------------------------------------------------------------------------
# the model


def test_predict_by_hand_and_limits():
    dev = roofline.DeviceSpec("toy", bf16_tflops=1.0, fp8_tflops=2.0, hbm_tbps=1.0, source="-")
    eff = roofline.Efficiency(bf16_gemm=1.0, fp8_gemm=1.0, hbm=1.0)
    m = k = n = 1024
    p = roofline.predict(m, k, n, "tensorwise", dev, eff)
    flops = 2 * m * k * n
    # compute bound at 1 TFLOP/s: ms = flops / 1e9
    assert p["bf16_ms"] == pytest.approx(3 * flops / 1e9)
    tr = roofline.TRAFFIC["tensorwise"]
    assert p["traffic_bytes"] == tr.bytes(m, k, n)
    assert p["float8_ms"] == pytest.approx(3 * flops / 2e9 + tr.bytes(m, k, n) / 1e9)
    # big shapes approach the fp8/bf16 rate ratio from below; small ones lose
    big = roofline.predicted_speedup(16384, 16384, 16384, "tensorwise", "h100")
    assert 1.5 < big < 1979.0 * 0.73 / (989.5 * 0.8)
    assert roofline.predicted_speedup(256, 256, 256, "tensorwise", "h100") < 1
    # more bandwidth, same tensor cores: the H200 is never predicted slower than the H100
    for shape in [(1024, 2048, 1024), (4096, 8192, 16384)]:
        assert roofline.predicted_speedup(*shape, device="h200") > roofline.predicted_speedup(
            *shape, device="h100"
        )


def test_seed_points_within_reach_of_the_model():
    # the torchao.float8 README's H100 measurements (torchao tensorwise): 0.80x at
    # 1024x2048x1024, 1.39x at 4096x8192x16384; the uncalibrated model is within 25% of both,
    # on the right side of 1
    small = roofline.predicted_speedup(1024, 2048, 1024, "tensorwise", "h100")
    large = roofline.predicted_speedup(4096, 8192, 16384, "tensorwise", "h100")
    assert small < 1 < large
    assert abs(small / 0.80 - 1) < 0.25 and abs(large / 1.39 - 1) < 0.25


def test_calibrate_recovers_the_efficiencies_that_made_the_rows():
    truth = roofline.Efficiency(bf16_gemm=0.6, fp8_gemm=0.5)
    rows = []
    for m, k, n in [(4096, 4096, 4096), (4096, 8192, 16384), (8192, 8192, 8192)]:
        p = roofline.predict(m, k, n, "tensorwise", "h100", truth)
        rows.append(
            dict(
                M=m,
                K=k,
                N=n,
                mode="fwd_bwd",
                recipe="tensorwise",
                bf16_ms=p["bf16_ms"],
                float8kit_ms=p["float8_ms"],
            )
        )
    rows.append(
        dict(M=16, K=16, N=16, mode="fwd_bwd", recipe="tensorwise", bf16_ms=1.0, float8kit_ms=9.0)
    )  # launch-bound: ignored
    got = roofline.calibrate(rows, "h100")
    assert got.bf16_gemm == pytest.approx(0.6) and got.fp8_gemm == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no compute-bound fwd_bwd rows"):
        roofline.calibrate(rows[-1:], "h100")


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="no device 'a100'"):
        roofline.predict(1, 1, 1, device="a100")
    with pytest.raises(ValueError, match="no traffic model for recipe 'x'"):
        roofline.predict(1, 1, 1, recipe="x")
    with pytest.raises(ValueError, match=r"Efficiency.hbm=1.5 must be in \(0, 1\]"):
        roofline.Efficiency(hbm=1.5)
    with pytest.raises(ValueError, match="tokens=0 must be a positive int"):
        float8kit.auto_module_filter("tensorwise", tokens=0)


def test_auto_module_filter_refuses_bad_arguments_naming_them():
    bad = {
        "tokens": [float("nan"), float("inf"), -1, 0, 0.5, True, "16384", None],
        "min_speedup": [float("nan"), float("inf"), 0, -1.0, "1", None, True],
        "efficiency": [{"fp8_gemm": 0.5}, 0.5],
        "recipe": [None, ["tensorwise"], "x"],
        "device": [0, None, "a100", torch.device("cpu")],
    }
    for arg, values in bad.items():
        for value in values:
            kwargs = {"tokens": 16384, arg: value}
            with pytest.raises(ValueError) as info:
                float8kit.auto_module_filter(**kwargs)
            message = str(info.value)  # names the argument and the value given
            assert arg in message and repr(value) in message, (arg, value, message)
    # an integral float is a token count
    big = nn.Linear(8192, 16384, device="meta")
    assert float8kit.auto_module_filter(tokens=16384.0)(big, "0")


def _as_cuda(name: str | None):
    """torch.cuda as seen on a machine with one GPU named ``name`` (None: no CUDA)."""
    return mock.patch.multiple(
        torch.cuda,
        is_available=lambda: name is not None,
        device_count=lambda: 1,
        get_device_name=lambda index=None: name,
    )


def test_auto_module_filter_takes_a_torch_device_by_its_gpu_name():
    dims = [(8192, 16384), (16384, 8192), (1024, 1024), (4096, 1024), (2048, 2048)]
    model = [nn.Linear(k, n, device="meta") for k, n in dims]
    for name, key in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                      ("NVIDIA B200", "b200")):  # fmt: skip
        by_key = float8kit.auto_module_filter(device=key, tokens=4096)
        with _as_cuda(name):
            assert roofline.device_spec(torch.device("cuda")) is roofline.DEVICES[key]
            assert roofline.device_spec(torch.device("cuda:0")) is roofline.DEVICES[key]
            by_device = float8kit.auto_module_filter(device=torch.device("cuda"), tokens=4096)
        keep = [by_key(m, str(i)) for i, m in enumerate(model)]
        assert [by_device(m, str(i)) for i, m in enumerate(model)] == keep
        assert True in keep and False in keep  # a decision the device changes, not a constant
    # other boards' peaks differ from DEVICES' SXM ones: refused, naming the fix
    for name in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA GH200 480GB", "NVIDIA A100"):
        with _as_cuda(name), pytest.raises(ValueError, match=rf"{name}.*pass a DeviceSpec"):
            float8kit.auto_module_filter(device=torch.device("cuda"), tokens=4096)
    with _as_cuda("NVIDIA H100 80GB HBM3"), pytest.raises(ValueError, match="1 CUDA device"):
        float8kit.auto_module_filter(device=torch.device("cuda:3"), tokens=4096)
    with _as_cuda(None), pytest.raises(ValueError, match="no CUDA .* pass its name"):
        float8kit.auto_module_filter(device=torch.device("cuda"), tokens=4096)


def test_auto_module_filter_converts_where_predicted_and_aligned():
    dims = [(8192, 16384), (16384, 8192), (256, 256), (8200, 8192)]
    model = [nn.Linear(k, n, device="meta") for k, n in dims]  # no 1 GB of weights
    fn = float8kit.auto_module_filter("tensorwise", device="h100", tokens=16384)
    keep = [fn(mod, str(i)) for i, mod in enumerate(model)]
    assert keep == [True, True, False, False]  # big wins; small loses; 8200 unaligned
    for i, mod in enumerate(model):
        if keep[i]:
            s = roofline.predicted_speedup(16384, mod.in_features, mod.out_features)
            assert s >= 1.0
    # fewer tokens per step: the same big layer no longer pays for its casts
    few = float8kit.auto_module_filter("tensorwise", device="h100", tokens=256)
    assert not few(model[0], "0")
    # a raised bar drops the marginal layers
    strict = float8kit.auto_module_filter("tensorwise", tokens=16384, min_speedup=10.0)
    assert not strict(model[0], "0")
    converted = float8kit.convert_to_float8_training(
        nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)),
        module_filter_fn=float8kit.auto_module_filter("tensorwise", tokens=64),
    )
    assert not any(isinstance(m, float8kit.Float8Linear) for m in converted)
    assert math.isfinite(roofline.predicted_speedup(1, 16, 16))


def test_train_filter_auto_converts_what_the_model_predicts():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    import train

    def build(*flags):
        args = train.parse_args(["--preset", "tiny", "--float8", "tensorwise", *flags])
        return args, train.build_model(args, torch.device("cpu"), 1, False)

    args, model = build("--filter", "auto", "--filter-device", "b200")
    tokens = args.batch_size * args.seq_len
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name != "output":
            want = (
                mod.in_features % 16 == 0
                and mod.out_features % 16 == 0
                and roofline.predicted_speedup(
                    tokens, mod.in_features, mod.out_features, "tensorwise", "b200"
                )
                >= 1.0
            )
            assert isinstance(mod, float8kit.Float8Linear) == want, name
    # the tiny preset's layers are far below any crossover: nothing is converted, where the
    # default filter converts every aligned block Linear
    assert not any(isinstance(m, float8kit.Float8Linear) for m in model.modules())
    _, default = build()
    assert any(isinstance(m, float8kit.Float8Linear) for m in default.modules())


def test_traffic_model_is_the_measured_count():
    # roofline.TRAFFIC is bench_traffic's per-element split as committed in numbers/
    rows = json.loads(
        (Path(__file__).resolve().parents[1] / "numbers" / "traffic.json").read_text()
    )
    measured = {
        r["recipe"]: r
        for r in rows["rows"]
        if r["impl"] == "float8kit" and r.get("per_element") and not r.get("scaled_from")
    }
    assert set(measured) == set(roofline.TRAFFIC)
    for recipe, t in roofline.TRAFFIC.items():
        pe = measured[recipe]["per_element"]
        assert (t.input, t.weight, t.grad_output) == (
            pe["input"],
            pe["weight"],
            pe["grad_output"],
        ), recipe
        assert t.kernels == measured[recipe]["kernels"], recipe


@pytest.mark.slow
def test_bench_traffic_script_bf16_rows(tmp_path):
    # the script end to end on its cheapest recipe: a bf16 layer moves nothing outside its
    # three gemms, each of which reads two bf16 operands and writes one
    import subprocess

    out = tmp_path / "traffic.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_traffic.py"
    args = ["--shapes", "256x512x1024", "--recipes", "bf16", "--no-torchao", "--json", str(out)]
    subprocess.run([sys.executable, str(script), *args], check=True, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    m, k, n = 256, 512, 1024
    (bf16,) = [r for r in rows if r["impl"] == "bf16" and r["shape"] == [m, k, n]]
    assert (bf16["bytes"], bf16["kernels"], bf16["gemms"], bf16["graphs"]) == (0, 0, 3, 2)
    assert bf16["gemm_bytes"] == 3 * 2 * (m * k + k * n + m * n)
    (scaled,) = [r for r in rows if r["impl"] == "bf16" and r["shape"] == [4096, 8192, 16384]]
    assert scaled["scaled_from"] == [m, k, n] and scaled["gemm_bytes"] == 256 * bf16["gemm_bytes"]
    assert [r["bytes"] for r in rows if r["impl"] == "minimum"] == [0, 0]


@pytest.mark.parametrize("recipe", ["static", "delayed"])
def test_delayed_and_static_casts_move_their_minimum_and_less_than_dynamic(recipe):
    # the one-pass cast (float8kit::cast_tensorwise): each operand read once in bf16, each
    # float8 layout written once, delayed's amax record in that pass; the weight's transposed
    # copy kept for backward; eager: one kernel per operand cast
    m, k, n = 64, 96, 160
    got = bench_traffic.count("float8kit", recipe, m, k, n)
    assert got["per_element"] == {"input": 4.0, "weight": 4.0, "grad_output": 4.0}
    assert got["bytes"] - got["other_bytes"] == bench_traffic.minimum_bytes(recipe, m, k, n)
    dynamic = bench_traffic.count("float8kit", "tensorwise", m, k, n)
    assert got["bytes"] < dynamic["bytes"]
    passes = bench_traffic.eager_passes("float8kit", recipe, m, k, n)
    assert passes == {"input": 1, "weight": 2, "grad_output": 1}  # weight: forward + re-cast


def test_traffic_count_splits_a_multi_output_ops_writes_by_output():
    # float8kit::cast_tensorwise returns (row data, transposed data, amax): its writes land
    # on the M*K buffers (1 B each layout), not on "other"
    x = torch.randn(48, 80, dtype=torch.bfloat16)
    scale = torch.tensor(2.0)

    def f(x, scale):
        row, col, _ = torch.ops.float8kit.cast_tensorwise(
            x, scale, torch.float8_e4m3fn, True, True, True, False
        )
        return row, col

    torch._dynamo.reset()
    with (
        bench_traffic.record_kernels() as graphs,
        torch._inductor.config.patch(force_disable_caches=True),
    ):
        torch.compile(f, fullgraph=True)(x, scale)
    torch._dynamo.reset()
    (op,) = [kr for g in graphs for kr in g if "cast_tensorwise" in kr.get("name", "")]
    assert op["by_numel"][48 * 80] == 48 * 80 * (2 + 1 + 1)
    assert op["bytes"] == 48 * 80 * 4 + 4  # + the fp32 scale read
