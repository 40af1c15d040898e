"""CI smoke tests of benchmarks/: each script at tiny CPU sizes, asserting on the JSON it writes.

The scripts run as subprocesses, the way a user runs them, into a temporary folder (never
benchmarks/results/). Together they take well under 90 s on two CPU cores. The numbers
checked are ones that hold on any machine: SQNR vs bf16, byte ratios, finite positive
timings, the roofline model's ordering; never a speedup, which CPU timing cannot promise.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
RUN_INFO_KEYS = {
    "device",
    "torch",
    "torchao",
    "date",
    "command",
    "script",
    "git_commit",
    "git_dirty",
    "rows",
}


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()


def run_script(name: str, out: Path, *args: str, timeout: int = 120) -> dict:
    """Run ``benchmarks/<name>.py ... --out out`` and return the JSON it wrote."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(BENCH / f"{name}.py"), *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    data = json.loads(out.read_text())
    assert RUN_INFO_KEYS <= data.keys()
    assert data["script"] == f"benchmarks/{name}.py"
    assert data["git_commit"] == git("rev-parse", "HEAD")
    # the tree of the files that ran (a device copy's git metadata may be stale): in a clean
    # checkout, HEAD's tree
    if git("status", "--porcelain") == "":
        assert data["git_tree"] == git("rev-parse", "HEAD^{tree}")
    assert data["sources"] == ["benchmarks/common.py", "float8kit"]
    assert data["rows"], "no rows written"
    assert out.with_suffix(".md").exists()
    return data


def test_bench_linear_sqnr_vs_bf16(tmp_path):
    data = run_script(
        "bench_linear",
        tmp_path / "linear.json",
        *("--smoke", "--threads", "1", "--iters", "2", "--timing", "back_to_back,synced"),
    )
    assert (tmp_path / "linear.png").exists()
    assert data["complete"] is True and data["timings"] == ["back_to_back", "synced"]
    recipes = {r["recipe"] for r in data["rows"]}
    assert {"tensorwise", "rowwise", "rowwise_with_gw_hp"} <= recipes
    assert {r["mode"] for r in data["rows"]} == {"fwd", "fwd_bwd"}
    for row in data["rows"]:
        for key in ("M", "K", "N", "recipe", "mode", "bf16_ms", "float8kit_ms"):
            assert key in row, (key, row)
        assert row["bf16_ms"] > 0 and row["float8kit_ms"] > 0
        # each timing has its own times and its own speedup over bf16's time in that timing
        for x in ("", "_synced"):
            want = round(row[f"bf16{x}_ms"] / row[f"float8kit{x}_ms"], 3)
            assert row[f"float8kit{x}_speedup"] == want, (x, row)
        # torchao runs every recipe it has (0.18: not delayed; then it says why, in the row)
        libs = ["float8kit"]
        if row["recipe"] in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
            assert "torchao_error" not in row, row
            assert row["torchao_ms"] > 0
            libs.append("torchao")
        else:
            assert "torchao_ms" in row or row["torchao_error"]
        # null = bit-identical to bf16; otherwise the worst of output/grads must be >= 20 dB
        # (NVFP4's 4-bit elements: >= 12 dB)
        floor = 12.0 if row["recipe"] == "nvfp4" else 20.0
        for lib in libs:
            sqnr = row[f"{lib}_sqnr_db"]
            assert sqnr is None or sqnr >= floor, (lib, row)
    assert data["failures"] == []
    assert "nvfp4" in recipes and data["min_sqnr_db_nvfp4"] == 12.0


def test_the_peers_cpu_gemm_stand_in_keeps_inductors_extern_kernel_name():
    # bench_linear --compile on CUDA failed with "'KernelNamespace' object has no attribute
    # '_scaled_mm'": the stand-in for torch._scaled_mm (the peer's CPU gemms on float8kit's
    # kernel) was named scaled_mm, so inductor registered its extern gemm under that name in
    # the benchmark's process, while a graph compiled by a process without the stand-in (the
    # GPU tests before it) and loaded from the FX graph cache calls extern_kernels._scaled_mm.
    # On a CUDA machine the stand-in is not installed at all (its Python call would be timed).
    code = """
import sys, torch
sys.path.insert(0, "benchmarks")
import common
real = torch._scaled_mm
torch.cuda.is_available = lambda: True
common.import_torchao_float8()
assert torch._scaled_mm is real, "stand-in installed on a CUDA machine"
torch.cuda.is_available = lambda: False
common.import_torchao_float8()
assert torch._scaled_mm is not real and torch._scaled_mm.real is real
from torch._inductor.select_algorithm import extern_kernels
import torch._inductor.compile_fx  # imports the lowerings, which register the extern gemm
print(sorted(n for n in vars(extern_kernels) if "scaled_mm" in n))
"""
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split("\n")[-2] == "['_scaled_mm']"


def test_recipes_a_gpu_cannot_run_are_skipped_with_the_reason(pretend_gpu):
    # what bench_linear / bench_train run and record as skipped (no GPU here: pretended)
    from benchmarks import common

    recipes = common.float8kit_recipes()
    assert "mxfp8" in recipes
    assert common.runnable_recipes(torch.device("cpu"), recipes) == (recipes, [])  # emulated
    pretend_gpu((9, 0))
    why = "mxfp8: its MX gemms need an sm100 (Blackwell) GPU; NVIDIA H200 is sm90"
    why_fp4 = "nvfp4: its NVFP4 gemms need an sm100 (Blackwell) GPU; NVIDIA H200 is sm90"
    no_mx = [r for r in recipes if r not in ("mxfp8", "nvfp4")]
    assert common.runnable_recipes(torch.device("cuda", 0), recipes) == (no_mx, [why, why_fp4])
    # named on the command line: skipped likewise; a name float8kit lacks is left to the script
    assert common.runnable_recipes(torch.device("cuda"), ["mxfp8", "rowwise", "nvfp9"]) == (
        ["rowwise", "nvfp9"],
        [why],
    )
    pretend_gpu((10, 0))
    assert common.runnable_recipes(torch.device("cuda", 0), recipes) == (recipes, [])


def test_bench_overhead_ratio(tmp_path):
    data = run_script(
        "bench_overhead",
        tmp_path / "overhead.json",
        "--threads",
        "1",
        "--rounds",
        "3",
        "--calls",
        "3",
        "--warmup",
        "3",
    )
    (row,) = data["rows"]
    ratio = row["ratio_float8kit_over_torchao"]
    assert math.isfinite(ratio) and ratio > 0
    assert row["float8kit_us"] > 0 and row["torchao_us"] > 0 and row["bf16_us"] > 0
    # the by-hand floor (eager tensorwise) ran, after the script checked it is bitwise ours
    assert row["byhand_bitwise"] is True and row["byhand_us"] > 0
    assert math.isfinite(row["ratio_float8kit_over_byhand"])
    assert row["byhand_aten_ops"] > 0


@pytest.mark.slow
def test_bench_overhead_compiled_counts_guards(tmp_path):
    data = run_script(
        "bench_overhead",
        tmp_path / "overhead.json",
        "--threads",
        "1",
        "--compile",
        "--rounds",
        "2",
        "--calls",
        "2",
        "--warmup",
        "2",
    )
    (row,) = data["rows"]
    assert data["compiled"] is True and row["compiled"] is True
    assert math.isfinite(row["ratio_float8kit_over_torchao"])
    # every library's compiled step has guards; a bf16 Linear needs no more than a float8 one
    assert 0 < row["bf16_guards"] <= min(row["float8kit_guards"], row["torchao_guards"])
    # the layer's Function is in the graph whole and takes its config as one interned int:
    # dynamo guards about what it guards for torchao's layer (at most 1.3x)
    assert row["float8kit_guards"] <= 1.3 * row["torchao_guards"]


@pytest.mark.slow
def test_bench_comm_bytes(tmp_path):
    data = run_script(
        "bench_comm",
        tmp_path / "comm.json",
        "--steps",
        "2",
        "--variants",
        "bf16,float8kit,float8kit_fp8_allgather,float8kit_delayed_fp8_allgather,"
        "torchao_fp8_allgather",
    )
    rows = {r["variant"]: r for r in data["rows"]}
    bf16 = rows["bf16"]
    assert bf16["status"] == "ok"
    # FSDP2, 2 blocks + root, reshard after forward: 3 forward + 2 backward all-gathers,
    # 3 reduce-scatters, no all-reduce (no HSDP, nothing float8 to precompute)
    assert (bf16["all_gather_calls"], bf16["reduce_scatter_calls"]) == (5, 3)
    assert bf16["all_reduce_calls"] == 0 and bf16["all_gather_dtypes"] == "bfloat16"
    # float8 compute without float8 all-gather moves exactly the bf16 bytes
    fk = rows["float8kit"]
    assert fk["status"] == "ok"
    assert fk["all_gather_bytes"] == bf16["all_gather_bytes"]
    assert fk["reduce_scatter_bytes"] == bf16["reduce_scatter_bytes"]
    for variant in (
        "float8kit_fp8_allgather",
        "float8kit_delayed_fp8_allgather",
        "torchao_fp8_allgather",
    ):
        row = rows[variant]
        assert row["status"] == "ok", row
        # fp8 linear weights are half the bytes of bf16; norms, embedding and lm head are not
        assert 0.5 <= row["all_gather_ratio_vs_bf16"] < 0.75, row
        assert row["reduce_scatter_bytes"] == bf16["reduce_scatter_bytes"]
        # the scale precompute after optimizer.step(): ONE collective for all scale state
        assert row["all_reduce_calls"] == 1, row
    # float8kit and torchao put the same float8 weights on the wire
    assert (
        rows["float8kit_fp8_allgather"]["all_gather_bytes"]
        == rows["torchao_fp8_allgather"]["all_gather_bytes"]
    )


def test_bench_train_tiny(tmp_path):
    data = run_script(
        "bench_train",
        tmp_path / "train.json",
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--no-compile",
        "--threads",
        "1",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--recipes",
        "tensorwise",
    )
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"bf16", "float8kit:tensorwise", "torchao:tensorwise"}
    assert data["complete"] is True  # written after every variant too, then marked complete
    for row in rows.values():
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and math.isfinite(row["loss_last"])
    for name in ("float8kit:tensorwise", "torchao:tensorwise"):
        # same weights, same first batch: float8 changes the first loss by far under 1%
        assert rows[name]["loss_first_rel_diff_vs_bf16"] < 0.01
        assert rows[name]["float8_linears"] == 14  # 2 blocks x 7 projections; head stays bf16


def test_bench_precompute_is_batched_across_layers(tmp_path):
    # precompute_scales updates every delayed layer's history with batched ops: the aten ops
    # it launches do not grow with the layer count (1 and 4 layers: the same count)
    data = run_script(
        "bench_precompute",
        tmp_path / "precompute.json",
        *("--device", "cpu", "--layers", "1,4", "--calls", "3", "--threads", "1"),
    )
    one, four = data["rows"]
    assert (one["layers"], four["layers"]) == (1, 4)
    assert one["aten_ops"] == four["aten_ops"] > 0
    for row in data["rows"]:
        assert row["host_us"] > 0
        assert row["host_us_per_layer"] == round(row["host_us"] / row["layers"], 1)
        assert "waits_for_gpu" not in row  # CPU: nothing to wait for


def test_roofline_measured(tmp_path):
    data = run_script(
        "roofline",
        tmp_path / "roofline.json",
        "--threads",
        "1",
        "--measure-size",
        "128",
        "--bw-mib",
        "8",
        "--warmup",
        "1",
        "--iters",
        "3",
        "--shapes",
        "tiny,square",
        "--modes",
        "fwd_bwd",
    )
    rates = data["rates"]
    assert rates["source"] == "measured"
    assert rates["bf16_tflops"] > 0 and rates["fp8_tflops"] > 0 and rates["bw_tbps"] > 0
    # every row is the model applied to the rates this run measured (the rates themselves
    # are timings: how they compare across shapes is the benchmark's to report, not a test's)
    sys.path.insert(0, str(BENCH))
    try:
        import roofline
    finally:
        sys.path.remove(str(BENCH))
    assert len(data["rows"]) >= 2
    for row in data["rows"]:
        want = roofline.predict(row["M"], row["K"], row["N"], row["mode"], rates)
        assert row["predicted_speedup"] == pytest.approx(want["predicted_speedup"], rel=1e-3)


def test_roofline_model_arithmetic():
    # In-process: predict() against the model computed by hand for made-up rates.
    sys.path.insert(0, str(BENCH))
    try:
        import roofline
    finally:
        sys.path.remove(str(BENCH))
    rates = {
        "host_overlaps_device": False,
        "bf16_tflops": 1.0,
        "fp8_tflops": 2.0,
        "bw_tbps": 0.01,
        "t0_us": {"bf16": {"fwd_bwd": 100.0}, "fp8": {"fwd_bwd": 300.0}},
    }
    m, k, n = 256, 512, 128
    flops = 3 * 2 * m * k * n  # three gemms
    cast_bytes = 7 * (m * k + k * n + m * n)
    bf16_ms = 0.1 + flops / 1e12 * 1e3
    fp8_ms = 0.3 + flops / 2e12 * 1e3 + cast_bytes / 1e10 * 1e3
    got = roofline.predict(m, k, n, "fwd_bwd", rates)
    assert got["predicted_speedup"] == pytest.approx(bf16_ms / fp8_ms, rel=1e-3)
    # on a GPU the host cost overlaps the device time: the larger of the two counts
    overlapped = roofline.predict(m, k, n, "fwd_bwd", {**rates, "host_overlaps_device": True})
    want = max(0.1, flops / 1e12 * 1e3) / max(0.3, flops / 2e12 * 1e3 + cast_bytes / 1e10 * 1e3)
    assert overlapped["predicted_speedup"] == pytest.approx(want, rel=1e-3)


def test_bench_experts_smoke_sqnr_vs_bf16(tmp_path):
    data = run_script(
        "bench_experts", tmp_path / "experts.json", "--smoke", "--threads", "1", "--iters", "2"
    )
    for row in data["rows"]:
        assert row["bf16_ms"] > 0 and row["float8kit_ms"] > 0
        assert row["float8kit_sqnr_db"] is not None and row["float8kit_sqnr_db"] >= 20, row


def test_step_profile_reads_busy_idle_and_the_first_gemm_from_a_trace():
    # In-process: read_trace() on a made-up Chrome trace (times in us), against what it says
    # by hand: two steps; the device's intervals overlap (a memcpy under a kernel) and the
    # GPU's copy of the step annotation spans them all (it must not count as busy).
    sys.path.insert(0, str(BENCH))
    try:
        import bench_step_profile as bsp
    finally:
        sys.path.remove(str(BENCH))

    def ev(name, cat, ts, dur):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}

    trace = {
        "traceEvents": [
            ev(bsp.STEP, "user_annotation", 1000, 500),
            ev(bsp.STEP, "gpu_user_annotation", 1040, 400),
            ev("cudaLaunchKernel", "cuda_runtime", 1010, 5),
            ev("cuLaunchKernelEx", "cuda_driver", 1020, 5),
            ev("triton_red_fused_abs_max_0", "kernel", 1040, 60),
            ev("Memcpy DtoD", "gpu_memcpy", 1050, 20),
            ev("nvjet_sm90_qqtst_128x256", "kernel", 1200, 240),
            ev(bsp.STEP, "user_annotation", 2000, 300),
            ev("sm90_xmma_gemm_e4m3", "kernel", 2100, 100),
            {"ph": "i", "name": "instant", "ts": 2050},
        ]
    }
    first, second = bsp.read_trace(trace, gpu=True)
    assert first["wall_us"] == 500 and second["wall_us"] == 300
    assert first["busy_us"] == 60 + 240 and second["busy_us"] == 100
    assert first["idle_us"] == 500 - 300 and second["idle_us"] == 300 - 100
    assert first["first_kernel_us"] == 40 and first["first_gemm_us"] == 200
    assert second["first_kernel_us"] == second["first_gemm_us"] == 100
    assert (first["launches"], first["kernels"], second["launches"]) == (2, 2, 0)
    row = bsp.summarize([first, second], n_top=2)
    assert row["wall_us"] == 400 and row["busy_us"] == 200 and row["idle_us"] == 200
    assert row["top"][0] == {"kernel": "nvjet_sm90_qqtst_128x256", "calls": 0.5, "us": 120}
    # without a GPU: the host columns only
    (cpu, _) = bsp.read_trace(trace, gpu=False)
    assert cpu["busy_us"] is None and cpu["idle_us"] is None and cpu["wall_us"] == 500


def test_bench_step_profile_runs_on_cpu(tmp_path):
    # the acceptance's part 2 runs it on the GPU: here its CPU run, host columns only
    out = tmp_path / "step_profile.json"
    data = run_script(
        "bench_step_profile", out, "--device", "cpu", "--shape", "32x64x32",
        "--recipes", "tensorwise", "--warmup", "1", "--steps", "2", "--threads", "1",
        timeout=300,
    )  # fmt: skip
    rows = {(r["impl"], r["recipe"]): r for r in data["rows"]}
    assert set(rows) == {("bf16", "bf16"), ("float8kit", "tensorwise"), ("torchao", "tensorwise")}
    for r in rows.values():
        assert r["wall_us"] > 0 and r["busy_us"] is None and r["idle_us"] is None
