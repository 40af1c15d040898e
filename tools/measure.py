"""Measure every number the docs publish; write one JSON file per source under numbers/.

    python tools/measure.py                    # all of them (see NAMES), in that order
    python tools/measure.py numerics scaling   # only some
    python tools/publish.py                    # then re-render the docs' tables from the JSON
    make numbers                               # both, with the .venv's python

Each file records what made it and where: the command, the script and the other files the
numbers depend on (``sources``), the git commit and whether the checkout was dirty (changes
outside numbers/ and *.md count), device, torch, torchao, torch threads, date, the machine's
load average at the start, wall time, and the numbers (``data``). The benchmark scripts write
their own files in the same shape (``benchmarks/common.py``'s ``run_info``).
tests/test_docs.py checks that every published table is the rendering of its file and that
every file was made from a clean checkout of a commit in this repository's history.

Run it on a quiet machine: the timings (tokens/s, benchmark medians) move with the load,
which each file records. Losses and SQNRs are deterministic on a given machine and thread
count.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NUMBERS = REPO / "numbers"
RUNS = REPO / "runs" / "numbers"  # training runs' folders (ignored by git)
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "recipes"))

import common  # noqa: E402  (benchmarks/common.py: run info, git commit and dirty flag)
import torch  # noqa: E402
from measures.cpu_dtype import AVX2_ONLY  # noqa: E402  (an AVX2-only CPU, emulated)

PY = sys.executable
# What a training subprocess gets: torch's default (OMP_NUM_THREADS when set), read before
# main() pins this process to one thread for the in-process measurements.
DEFAULT_THREADS = torch.get_num_threads()
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def run(*args: str, env: dict[str, str] | None = None) -> float:
    """Run ``python ARGS`` from the repository root (``env`` added to the environment);
    return its wall time in s."""
    t0 = time.perf_counter()
    print("+", *[f"{k}={v}" for k, v in (env or {}).items()], "python", " ".join(args), flush=True)
    subprocess.run([PY, *args], cwd=REPO, env={**ENV, **(env or {})}, check=True)
    return time.perf_counter() - t0


@contextlib.contextmanager
def avx2_env():
    """What a process needs added to run as on an AVX2-only CPU: AVX2_ONLY and the fresh
    inductor cache such a process needs (benchmarks/measures/cpu_dtype.py)."""
    with tempfile.TemporaryDirectory() as cache:
        yield {**AVX2_ONLY, "TORCHINDUCTOR_CACHE_DIR": cache}


def write(name: str, sources: list[str], data: dict, wall_s: float, threads: int = 1) -> Path:
    """numbers/NAME.json: provenance + ``data``; ``threads`` = the torch threads it ran with."""
    own = torch.get_num_threads()
    torch.set_num_threads(threads)  # run_info's device line names the thread count
    info = common.run_info(torch.device("cpu"))
    torch.set_num_threads(own)
    info.update(
        command=f"python tools/measure.py {name}",
        script="tools/measure.py",
        # a number is stale when the library or its measuring code changed
        sources=[*sources, "float8kit"],
        threads=threads,
        wall_s=round(wall_s, 1),
    )
    path = NUMBERS / f"{name}.json"
    path.write_text(
        json.dumps({"name": name, **info, "data": data}, indent=2, allow_nan=False) + "\n"
    )
    print(f"wrote {path.relative_to(REPO)}", flush=True)
    return path


# The measuring code each number comes from (benchmarks/measures/, never a test module: the
# tests import it to assert). With float8kit (added by write), what makes a number stale.
_M = "benchmarks/measures"
MEASURES = {
    "numerics": [f"{_M}/numerics.py", f"{_M}/refs.py", "benchmarks/common.py"],
    "memory": [f"{_M}/memory.py"],
    "monitor": [f"{_M}/monitor.py", f"{_M}/refs.py", "benchmarks/common.py"],
    "experts": [f"{_M}/experts.py", f"{_M}/refs.py", "benchmarks/common.py"],
    "moe_hf": [f"{_M}/experts_hf.py", f"{_M}/refs.py", "benchmarks/common.py"],
    "fsdp": [
        f"{_M}/fsdp.py",
        f"{_M}/fsdp_rowwise.py",
        f"{_M}/gloo.py",
        f"{_M}/refs.py",
        "benchmarks/common.py",
    ],
    "fsdp_blockwise": [f"{_M}/fsdp_blockwise.py", f"{_M}/gloo.py"],
    "fsdp_mx": [f"{_M}/fsdp_mx.py", f"{_M}/gloo.py"],
    "nvfp4": [f"{_M}/nvfp4.py", f"{_M}/refs.py"],
    "fsdp_nvfp4": [f"{_M}/fsdp_nvfp4.py", f"{_M}/fsdp_mx.py", f"{_M}/gloo.py"],
    "expert_parallel": [f"{_M}/expert_parallel.py", f"{_M}/gloo.py", "recipes/model.py"],
    "fsdp_mesh": [f"{_M}/fsdp_mesh.py", f"{_M}/gloo.py"],
    "qgz": [f"{_M}/qgz.py", f"{_M}/gloo.py", f"{_M}/refs.py", "benchmarks/common.py"],
    "tp": [f"{_M}/tp.py", f"{_M}/gloo.py"],
    "memory_blocks": [f"{_M}/memory_blocks.py", f"{_M}/memory.py", "recipes/model.py"],
}


# ---------------------------------------------------------------------------- training runs


def compare_data(out: Path, argv: list[str]) -> dict:
    """What numbers/NAME.json keeps of a compare.py run in ``out``: its summary.json, each
    run's numbers recomputed from its metrics.jsonl (and checked against the summary), the
    config of its first run."""
    import compare

    summary = json.loads((out / "summary.json").read_text())
    # recomputed from the runs' metrics.jsonl: the report's numbers are what the runs logged
    runs = {}
    for run_name in summary["runs"]:
        lines = (out / run_name / "metrics.jsonl").read_text().splitlines()
        runs[run_name] = compare.summarize([json.loads(line) for line in lines])
    assert runs == summary["runs"], "compare.py's summary.json disagrees with its runs"
    modes, seeds = summary["modes"], summary["seeds"]
    assert summary["stats"] == compare.mode_stats(runs, modes, seeds)
    cfg = json.loads((out / compare.run_name(modes[0], seeds[0]) / "config.json").read_text())
    return {
        "compare_argv": argv,
        **summary,
        "device": cfg["device"],
        "n_params": cfg["n_params"],
        "train_args": {
            k: cfg["args"][k] for k in ("preset", "steps", "batch_size", "seq_len", "seed")
        },
    }


def compare_runs(name: str, argv: list[str], env: dict[str, str] | None = None, **extra) -> None:
    """recipes/compare.py with ``argv`` (``env`` added to its environment); its summary,
    config and wall time."""
    out = RUNS / name
    rel = str(out.relative_to(REPO))
    wall = run("recipes/compare.py", *argv, "--out", rel, "--overwrite", "--quiet", env=env)
    data = {**compare_data(out, argv), **extra, **({"env": env} if env else {})}
    if (out / "loss.png").exists():
        (NUMBERS / f"{name}_loss.png").write_bytes((out / "loss.png").read_bytes())
    cfg = json.loads((out / next(iter(data["runs"])) / "config.json").read_text())
    write(
        name,
        [
            "recipes/compare.py",
            "recipes/train.py",
            "recipes/cli.py",
            "recipes/model.py",
            "recipes/data.py",
            "recipes/corpus",
        ],
        data,
        wall,
        threads=cfg["threads"],
    )


def demo() -> None:
    """`make demo`'s run: the small preset, hp vs float8 tensorwise, 3 seeds each (the
    defaults; hp = this CPU's hp dtype, FLOAT8KIT_CPU_HP_DTYPE=float32 forces fp32)."""
    compare_runs("demo", ["--preset", "small"])


def optim_small(name: str) -> Callable[[], None]:
    """`make demo`'s run (the small preset, hp vs float8 tensorwise, 3 seeds) with --optim
    ``name``: docs/optim.md sets it beside demo's, which trains with torch's AdamW."""
    return lambda: compare_runs(f"optim_small_{name}", ["--preset", "small", "--optim", name])


def demo_busy() -> None:
    """`make demo` again while two other processes keep both cores busy (a shared machine):
    the run time a user of a loaded machine sees, and the same losses."""
    busy = [subprocess.Popen([PY, "-c", "while True: pass"]) for _ in range(2)]
    try:
        compare_runs("demo_busy", ["--preset", "small"], busy_processes=len(busy))
    finally:
        for b in busy:
            b.kill()
            b.wait()


def demo_avx2() -> None:
    """`make demo` as an AVX2-only CPU runs it (AVX2_ONLY): hp is fp32 there."""
    compare_runs("demo_avx2", ["--preset", "small"], env=AVX2_ONLY)


def tiny() -> None:
    """Every --float8 mode on the tiny preset (60 steps), the nvfp4 ablations included."""
    compare_runs(
        "tiny",
        ["--preset", "tiny", "--modes", ",".join(TINY_MODES)],
    )


def nvfp4_small() -> None:
    """The nvfp4 recipe and its ablations (without its Hadamard transform, its stochastic
    rounding, its hp tail) on the small preset, where every block Linear can run NVFP4."""
    compare_runs(
        "nvfp4_small",
        ["--preset", "small", "--modes", "none,nvfp4,nvfp4_no_rht,nvfp4_no_sr,nvfp4_no_tail"],
    )


# every recipe, and the nvfp4 recipe less each of its parts (the ablation)
TINY_MODES = [
    "none",
    "tensorwise",
    "rowwise",
    "rowwise_with_gw_hp",
    "delayed",
    "mxfp8",
    "nvfp4",
    "nvfp4_no_rht",
    "nvfp4_no_sr",
    "nvfp4_no_tail",
]


# ---------------------------------------------------------------------------- numerics


def numerics() -> None:
    from benchmarks.measures import numerics as n

    t0 = time.perf_counter()
    rows = n.sqnr_table()
    write(
        "numerics",
        MEASURES["numerics"],
        {
            "rows": rows,
            "thresholds_db": n.ACCURACY_DB,
            # share of 100,006 wide-range amaxes whose scale the old two-rounding form
            # (fp8_max / amax as reciprocal * fp8_max) got one ulp off (0.2 and before)
            "old_scale_form_off_share": {
                str(d): n.one_ulp_off_share(n.random_amaxes(), d)
                for d in (torch.float8_e4m3fn, torch.float8_e5m2)
            },
        },
        time.perf_counter() - t0,
    )


def scaling() -> None:
    from benchmarks.measures import numerics as n

    t0 = time.perf_counter()
    write(
        "scaling",
        MEASURES["numerics"],
        n.scaling_policy_sqnrs(),
        time.perf_counter() - t0,
    )


def mx_numerics() -> None:
    """mxfp8 (RCEIL and FLOOR) against fp32 beside torchao 0.18's emulated MXFP8, on the
    issue's bar case and with outliers."""
    from benchmarks.measures import numerics as n

    t0 = time.perf_counter()
    write(
        "mx_numerics",
        MEASURES["numerics"],
        {
            "rows": n.mx_sqnr_table(),
            "thresholds_db": n.MX_ACCURACY_DB,
            "outlier_columns": n.MX_OUTLIER_COLUMNS,
        },
        time.perf_counter() - t0,
    )


def nvfp4_numerics() -> None:
    """The nvfp4 recipe and its ablations against fp64 on the issue's bar (one pass, and
    grad_weight averaged over 64 passes), beside torchao 0.18's NVFP4 cast."""
    from benchmarks.measures import nvfp4 as n

    t0 = time.perf_counter()
    write(
        "nvfp4_numerics",
        MEASURES["nvfp4"],
        {
            "rows": n.sqnr_table(),
            "thresholds_db": n.ACCURACY_DB,
            "averaged_passes": n.AVERAGED_PASSES,
            "outlier_columns": n.OUTLIER_COLUMNS,
            "spikes": n.SPIKES,
        },
        time.perf_counter() - t0,
    )


def outliers() -> None:
    """tensorwise, rowwise and blockwise on outlier channels and an outlier weight block."""
    from benchmarks.measures import numerics as n

    t0 = time.perf_counter()
    write(
        "outliers",
        MEASURES["numerics"],
        {
            "rows": n.outlier_sqnrs(),
            "outlier_channels": n.OUTLIER_CHANNELS,
            "blockwise_floor_db": n.BLOCKWISE_FLOOR_DB,
        },
        time.perf_counter() - t0,
    )


def memory() -> None:
    """Bytes kept for backward: per layer and token for every recipe, and one
    recipes/train.py step at the small preset per --float8 mode (benchmarks/measures/memory.py)."""
    from benchmarks.measures import memory as mem

    t0 = time.perf_counter()
    write(
        "memory",
        [*MEASURES["memory"], "recipes/train.py", "recipes/model.py"],
        {
            "per_layer": mem.saved_bytes_table(),
            "train_step": mem.train_step_saved_bytes("small"),
        },
        time.perf_counter() - t0,
    )


def monitor() -> None:
    """Float8Monitor: the drift case (a STATIC input scale, then 100x data) and its guardrail,
    and the time of a sampled and an unsampled step (benchmarks/measures/monitor.py)."""
    from benchmarks.measures import monitor as mon

    def finite(x):  # JSON has no inf: an exact (hp) result is written as null
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, list):
            return [finite(v) for v in x]
        return None if isinstance(x, float) and not math.isfinite(x) else x

    t0 = time.perf_counter()
    case = mon.drift_case()
    write(
        "monitor",
        [*MEASURES["monitor"], "float8kit/monitor.py"],
        {
            "drift": finite({k: v for k, v in case.items() if k != "warnings"}),
            "overhead": mon.monitor_overhead(),
        },
        time.perf_counter() - t0,
    )


def memory_blocks() -> None:
    """Bytes kept for backward by one transformer block (an HF LlamaDecoderLayer and the
    recipes' Block), every recipe, without checkpointing, with recompute_norms, with
    checkpoint_policy and with full checkpointing (benchmarks/measures/memory_blocks.py)."""
    from benchmarks.measures import memory_blocks

    t0 = time.perf_counter()
    write(
        "memory_blocks",
        [*MEASURES["memory_blocks"], "recipes/model.py"],
        memory_blocks.memory_table(),
        time.perf_counter() - t0,
    )


def memory_compiled() -> None:
    """Bytes a compiled HF LlamaDecoderLayer saves for backward, bf16 and float8 (the
    float8 tensors it saves, the float8 casts of its forward graph)
    (benchmarks/measures/memory_blocks.py)."""
    from benchmarks.measures import memory_blocks

    t0 = time.perf_counter()
    write(
        "memory_compiled",
        MEASURES["memory_blocks"],
        memory_blocks.compiled_table(),
        time.perf_counter() - t0,
    )


def experts() -> None:
    """float8 MoE experts (benchmarks/measures/experts.py): SQNR vs fp32 of two grouped gemms
    with SiLU between, 4 experts, one with no tokens."""
    from benchmarks.measures import experts as e

    t0 = time.perf_counter()
    scores, grads = e.experts_sqnrs()
    data = {
        "sqnr_db": scores,
        "threshold_db": e.ACCURACY_DB,
        "empty_expert_grad_exactly_zero": all(bool(g[1].abs().max() == 0) for g in grads),
        "shapes": {
            "tokens": e.TOKENS,
            "dim": e.DIM,
            "hidden": e.HIDDEN,
            "offs": e.OFFS.tolist(),
        },
    }
    write("experts", MEASURES["experts"], data, time.perf_counter() - t0)


def moe_hf() -> None:
    """float8 experts on a tiny Hugging Face Qwen3-MoE (benchmarks/measures/experts_hf.py):
    expert-only and whole-model SQNR, routing flips, float8 gemm counts per experts
    implementation, 30 training steps fp32 vs float8 experts."""
    from benchmarks.measures import experts_hf

    t0 = time.perf_counter()
    data = experts_hf.hf_numbers()
    write(
        "moe_hf",
        MEASURES["moe_hf"],
        data,
        time.perf_counter() - t0,
    )


def moe_tiny() -> None:
    """The moe-tiny preset (8 routed experts, top-2): bf16 vs rowwise, mxfp8,
    mxfp8_wgrad_with_hp and nvfp4 (its experts rowwise), 40 steps."""
    modes = "none,rowwise,mxfp8,mxfp8_wgrad_with_hp,nvfp4"
    compare_runs("moe_tiny", ["--preset", "moe-tiny", "--modes", modes])


EP_COMPARE = ["--preset", "moe-tiny", "--modes", "none,rowwise,mxfp8", "--nproc", "2"]


def moe_tiny_ep() -> None:
    """The moe-tiny preset on 2 gloo ranks with expert parallelism (train.py --ep 2: each rank
    holds 4 of the 8 experts, tokens cross in float8; mode none = bf16 experts, hp exchange),
    3 seeds per mode."""
    compare_runs("moe_tiny_ep", [*EP_COMPARE, "--ep", "2"])


def moe_tiny_dp2() -> None:
    """The same 2-rank runs without expert parallelism (every rank holds every expert): what
    moe_tiny_ep's losses are held against."""
    compare_runs("moe_tiny_dp2", EP_COMPARE)


def fsdp() -> None:
    """FSDP2's multi-process runs (2 and 3 gloo ranks; benchmarks/measures/fsdp.py and
    fsdp_rowwise.py, which tests/test_fsdp.py and tests/test_fsdp_rowwise.py assert on); rank
    0's numbers."""
    from benchmarks.measures import fsdp_rowwise as tr
    from benchmarks.measures.gloo import _rel_diff, spawn

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for sub in ("train2", "uneven3", "compile2", "row2", "row3", "rowc2"):
            (tmp / sub).mkdir()
        train2 = spawn("benchmarks.measures.fsdp:_worker_train", 2, tmp / "train2")
        uneven3 = spawn("benchmarks.measures.fsdp:_worker_uneven", 3, tmp / "uneven3")
        compile2 = spawn("benchmarks.measures.fsdp:_worker_compile", 2, tmp / "compile2")
        row2 = spawn("benchmarks.measures.fsdp_rowwise:_worker_rowwise", 2, tmp / "row2")
        row3 = spawn("benchmarks.measures.fsdp_rowwise:_worker_uneven_rowwise", 3, tmp / "row3")
        rowc2 = spawn("benchmarks.measures.fsdp_rowwise:_worker_compile_rowwise", 2, tmp / "rowc2")
    r, u, c = train2[0], uneven3[0], compile2[0]
    data = {
        "all_gather_bytes_fp8": r["all_gather_bytes_fp8"],
        "all_gather_bytes_bf16": r["all_gather_bytes_bf16"],
        "all_gather_calls_fp8": r["all_gather_calls_fp8"],
        "all_gather_calls_bf16": r["all_gather_calls_bf16"],
        "float8_weights": len(r["precomputed_scales"]),
        "precompute_all_reduces": r["precompute_all_reduces"],
        "fwd_bwd_all_reduces_after_precompute": r["fwd_bwd_all_reduces_after_precompute"],
        "forward_all_reduces_without_precompute": r["forward_all_reduces_without_precompute"],
        "fp32_same_batch_bitwise": r["fp32_replicated_data"] == r["ref_fp32"],
        "fp32_split_rel_diff": _rel_diff(r["fp32"], r["ref_fp32"]),
        "bf16_split_rel_diff": _rel_diff(r["bf16"], r["ref_bf16"]),
        "uneven_split_rel_diff": _rel_diff(u["uneven"], u["ref"]),
        "uneven_same_batch_bitwise": u["uneven_replicated_data"] == u["ref"],
        "uneven_local_rows": [x["local_rows"] for x in uneven3],
        "precomputed_scales_bitwise": r["precomputed_scales"] == r["full_weight_scales"],
        "dcp_resume_bitwise": all(x["resumed"] == x["after"] for x in uneven3),
        "compiled_vs_eager_rel_diff": _rel_diff(c["compiled"], c["eager"]),
        "compiled_graph_breaks": c["graph_breaks"],
        # compile + activation checkpointing vs one device eager: the largest rel. diff
        # over per-block / whole-model compile and the tensorwise / delayed recipes
        "compile_ac_rel_diff": max(
            _rel_diff(c[f"ac_{setup}_{name}"], c[f"ac_ref_{name}"])
            for setup in ("block", "whole")
            for name in ("tensorwise", "delayed")
        ),
        "steps": len(r["fp32"]),
    }
    for policy in ("delayed", "static"):
        data[f"{policy}_same_batch_bitwise"] = r[f"{policy}_replicated_data"] == r[f"{policy}_ref"]
        data[f"{policy}_split_rel_diff"] = _rel_diff(r[f"{policy}_split"], r[f"{policy}_ref"])
        data[f"{policy}_precompute_all_reduces"] = r[f"{policy}_precompute_all_reduces"]
        data[f"{policy}_fwd_bwd_all_reduces"] = r[f"{policy}_fwd_bwd_all_reduces"]
    data["rowwise"] = _fsdp_rowwise(tr, row2, row3, rowc2)
    # the grad_input re-cast of the gathered weight vs casting hp (one process)
    for recipe in tr.RECIPES:
        for name, kwargs in (
            ("normal", {"spread": False}),
            ("spread", {"spread": True}),
            ("no_pow2", {"spread": False, "pow2": False}),
        ):
            value = tr.recast_sqnr(recipe, **kwargs)
            data["rowwise"][recipe][f"recast_sqnr_{name}"] = None if math.isinf(value) else value
    data["rowwise"]["tensorwise_reshard_True_ratio"] = (
        r["all_gather_bytes_fp8"] / r["all_gather_bytes_bf16"]
    )
    write(
        "fsdp",
        MEASURES["fsdp"],
        data,
        time.perf_counter() - t0,
    )


def _fsdp_rowwise(tr, row2: list[dict], row3: list[dict], rowc2: list[dict]) -> dict:
    """The rowwise recipes' numbers (benchmarks/measures/fsdp_rowwise.py), rank 0's."""
    from benchmarks.measures.gloo import _rel_diff
    from benchmarks.measures.refs import sqnr

    r, u, c = row2[0], row3[0], rowc2[0]
    data: dict = {
        "mix_precompute_all_reduces": r["mix_precompute_all_reduces"],
        "mix_fwd_bwd_all_reduces": r["mix_fwd_bwd_all_reduces"],
        "uneven_local_rows": [x["local_rows"] for x in row3],
        "dcp_resume_bitwise": all(x["resumed"] == x["after"] for x in row3),
    }
    for recipe in tr.RECIPES:
        d = data[recipe] = {
            "split_rel_diff": _rel_diff(r[f"{recipe}_split"], r[f"{recipe}_ref"]),
            "same_batch_bitwise": r[f"{recipe}_replicated"] == r[f"{recipe}_ref"],
            "bf16_no_reshard_rel_diff": _rel_diff(r[f"{recipe}_bf16"], r[f"{recipe}_ref_bf16"]),
            "hook_path_bitwise": r[f"{recipe}_no_precompute"] == r[f"{recipe}_split"],
            "scales_bitwise": r[f"{recipe}_scales_bitwise"],
            "uneven_split_rel_diff": _rel_diff(u[f"{recipe}_uneven"], u[f"{recipe}_ref"]),
            "uneven_same_batch_bitwise": u[f"{recipe}_uneven_replicated"] == u[f"{recipe}_ref"],
            "compile_ac_bitwise": c[f"ac_{recipe}"] == c[f"ac_ref_{recipe}"],
        }
        for reshard in (True, False):
            got, ref = r[f"{recipe}_grads_reshard_{reshard}"], r[f"{recipe}_grads_ref"]
            grads = zip(got, ref, strict=True)
            lowest = min(sqnr(b, a) for a, b in grads)
            # JSON has no inf: None = every gradient bitwise equal (infinite SQNR)
            d[f"grad_sqnr_min_reshard_{reshard}"] = None if math.isinf(lowest) else lowest
            fp8, bf16 = f"{recipe}_reshard_{reshard}_fp8", f"{recipe}_reshard_{reshard}_bf16"
            d[f"reshard_{reshard}_all_gather_bytes"] = r[f"{fp8}_all_gather_bytes"]
            d[f"reshard_{reshard}_scale_bytes"] = r[f"{fp8}_precompute_bytes"]
            d[f"reshard_{reshard}_bf16_bytes"] = r[f"{bf16}_all_gather_bytes"]
            d[f"reshard_{reshard}_all_gathers"] = r[f"{fp8}_all_gather_calls"]
    return data


def fsdp_blockwise() -> None:
    """FSDP2 with blockwise weights (2 and 3 gloo ranks; benchmarks/measures/fsdp_blockwise.py);
    rank 0's numbers."""
    from benchmarks.measures.gloo import _rel_diff, spawn

    t0 = time.perf_counter()
    data = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (2, 3):
            (Path(tmp) / str(world)).mkdir()
            ranks = spawn(
                "benchmarks.measures.fsdp_blockwise:_worker_blockwise",
                world,
                Path(tmp) / str(world),
            )
            r = ranks[0]
            data[f"ranks{world}"] = {
                "all_gather_bytes_fp8": r["all_gather_bytes_fp8"],
                "all_gather_bytes_bf16": r["all_gather_bytes_bf16"],
                "split_rel_diff": _rel_diff(r["split"], r["ref"]),
                "same_batch_bitwise": all(x["replicated"] == r["ref"] for x in ranks),
                "precompute_all_reduces": r["precompute_all_reduces"],
                "fwd_bwd_all_reduces": r["fwd_bwd_all_reduces"],
                "steps": len(r["split"]),
            }
        # shards that cut 128-row blocks: 1024- and 256-row weights on 3 ranks
        r = ranks[0]
        data["cut_ranks3"] = {
            "local_rows": r["cut_local_rows"],
            "split_rel_diff": _rel_diff(r["cut_split"], r["cut_ref"]),
            "same_batch_bitwise": all(x["cut_replicated"] == r["cut_ref"] for x in ranks),
            "precompute_all_reduces": r["cut_precompute_all_reduces"],
            "fwd_bwd_all_reduces": r["cut_fwd_bwd_all_reduces"],
        }
    write(
        "fsdp_blockwise",
        MEASURES["fsdp_blockwise"],
        data,
        time.perf_counter() - t0,
    )


def fsdp_mx() -> None:
    """FSDP2 float8 all-gather of mxfp8 weights (2 and 3 gloo ranks;
    benchmarks/measures/fsdp_mx.py, which tests/test_fsdp_mx.py asserts on): bytes per pass
    against the bf16 all-gather, which copy each pass gathered, bitwise checks; rank 0's."""
    from benchmarks.measures import fsdp_mx as m
    from benchmarks.measures.gloo import spawn

    t0 = time.perf_counter()
    data: dict = {"layers": [list(x) for x in m.LAYERS], "steps": m.STEPS}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (2, 3):
            (Path(tmp) / str(world)).mkdir()
            ranks = spawn("benchmarks.measures.fsdp_mx:_worker_mx", world, Path(tmp) / str(world))
            r = ranks[0]
            passes = {}
            for name in ("forward", "backward"):
                fp8 = sum(r["bytes_fp8"][name].values())
                bf16 = sum(r["bytes_bf16"][name].values())
                passes[name] = {"fp8": fp8, "bf16": bf16, "ratio": fp8 / bf16}
            data[f"ranks{world}"] = {
                "local_rows": r["local_rows"],
                "passes": passes,
                "forward_copies": r["forward_copies"],
                "backward_copies": r["backward_copies"],
                "copies_bitwise_one_device": all(r["forward_bitwise"] + r["backward_bitwise"]),
                "losses_bitwise_hp_all_gather": all(
                    x["losses_fp8"] == x["losses_hp"] for x in ranks
                ),
                "grads_bitwise_hp_all_gather": all(all(x["grads_bitwise"]) for x in ranks),
                "no_reshard_bytes_fp8": r["no_reshard_bytes_fp8"],
            }
    write("fsdp_mx", MEASURES["fsdp_mx"], data, time.perf_counter() - t0)


def fsdp_nvfp4() -> None:
    """FSDP2 float8 all-gather of nvfp4 weights (2 and 3 gloo ranks;
    benchmarks/measures/fsdp_nvfp4.py, which tests/test_fsdp_nvfp4.py asserts on): bytes per
    pass against the bf16 all-gather, bitwise checks; rank 0's bytes."""
    from benchmarks.measures import fsdp_nvfp4 as m
    from benchmarks.measures.gloo import spawn

    t0 = time.perf_counter()
    data: dict = {"layers": [list(x) for x in m.LAYERS], "steps": m.STEPS}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (2, 3):
            (Path(tmp) / str(world)).mkdir()
            where = Path(tmp) / str(world)
            ranks = spawn("benchmarks.measures.fsdp_nvfp4:_worker_nvfp4", world, where)
            r = ranks[0]
            passes = {}
            for name in ("forward", "backward"):
                fp4 = sum(r["bytes_fp4"][name].values())
                bf16 = sum(r["bytes_bf16"][name].values())
                passes[name] = {"fp4": fp4, "bf16": bf16, "ratio": fp4 / bf16}
            data[f"ranks{world}"] = {
                "local_rows": r["local_rows"],
                "passes": passes,
                "weights_bitwise_one_device": all(
                    all(x["forward_bitwise"] + x["backward_bitwise"]) for x in ranks
                ),
                "losses_bitwise_hp_all_gather": all(
                    x["losses_fp4"] == x["losses_hp"] for x in ranks
                ),
                "grads_bitwise_hp_all_gather": all(all(x["grads_bitwise"]) for x in ranks),
            }
    write("fsdp_nvfp4", MEASURES["fsdp_nvfp4"], data, time.perf_counter() - t0)


def expert_parallel() -> None:
    """Expert parallelism on 2 and 4 gloo ranks (benchmarks/measures/expert_parallel.py, which
    tests/test_expert_parallel.py asserts on): all-to-all bytes per phase summed over the
    ranks and the routing cases, against the bf16 (hp) exchange; bitwise one rank; host
    reads per step."""
    from benchmarks.measures import expert_parallel as m
    from benchmarks.measures.gloo import spawn

    t0 = time.perf_counter()
    phases = ["counts", "dispatch", "combine", "combine_backward", "dispatch_backward"]
    data: dict = {"dim": m.DIM, "hidden": m.HIDDEN, "experts": m.EXPERTS, "phases": phases}
    data["cases"] = [c[0] for c in m.CASES]
    with tempfile.TemporaryDirectory() as tmp:
        for world in (2, 4):
            (Path(tmp) / str(world)).mkdir()
            ranks = spawn(
                "benchmarks.measures.expert_parallel:_worker_ep", world, Path(tmp) / str(world)
            )
            runs: dict = {}
            for key in ranks[0]:
                _, config, comm, dtype = key.split("/")
                run = runs.setdefault(f"{config}/{comm}/{dtype}", {p: 0 for p in phases})
                run.setdefault("bitwise_one_rank", True)
                run.setdefault("host_reads_per_step", set())
                for r in ranks:
                    x = r[key]
                    for p, b in zip(phases, x["all_to_all_bytes"], strict=True):
                        run[p] += b
                    run["bitwise_one_rank"] &= bool(
                        x["out"] and x["grad_input"] and all(x["grad_weight"].values())
                    )
                    run["host_reads_per_step"].add(x["host_reads"])
            for run in runs.values():
                run["host_reads_per_step"] = sorted(run["host_reads_per_step"])
            data[f"ep{world}"] = runs
    write("expert_parallel", MEASURES["expert_parallel"], data, time.perf_counter() - t0)


def fsdp_mesh() -> None:
    """benchmarks/measures/fsdp_mesh.py's run (4 gloo ranks: FSDP2 x TP 2x2 and 1x2, HSDP
    2x2), every recipe with and without float8 all-gather; losses of all ranks, bytes of rank 0."""
    from benchmarks.measures import fsdp_mesh as m
    from benchmarks.measures.gloo import _rel_diff, spawn

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = spawn("benchmarks.measures.fsdp_mesh:_worker_mesh", 4, Path(tmp))
    r0 = ranks[0]
    data: dict = {"steps": m.STEPS, "dim": m.DIM, "hidden": m.HIDDEN, "batch": m.BATCH}
    for mesh in ("2x2", "hsdp", "1x2"):
        bf16 = r0[mesh, "tensorwise", False, "all_gather_bytes"]
        data[mesh] = {
            recipe: {
                "loss_rel_diff": max(
                    _rel_diff(r[mesh, recipe, True], r[mesh, recipe, False]) for r in ranks
                ),
                "all_gather_bytes_fp8": r0[mesh, recipe, True, "all_gather_bytes"],
                "all_gather_bytes_bf16": bf16,
                "precompute_all_reduces": r0[mesh, recipe, True, "precompute_all_reduces"],
                "fwd_bwd_extra_all_reduces": r0[mesh, recipe, True, "fwd_bwd_all_reduces"]
                - r0[mesh, recipe, False, "fwd_bwd_all_reduces"],
            }
            for recipe in m.RECIPES
        }
        data[mesh]["whole_weight_scales"] = all(r[mesh, "whole_weight_scales"] for r in ranks)
    write(
        "fsdp_mesh",
        MEASURES["fsdp_mesh"],
        data,
        time.perf_counter() - t0,
    )


def qgz() -> None:
    """benchmarks/measures/qgz.py's gloo runs (2 and 3 ranks): FSDP2's default gradient
    reduce-scatter against the float8 one (qgZ); rank 0's numbers."""
    import statistics

    from benchmarks.measures import qgz as q
    from benchmarks.measures.gloo import spawn

    t0 = time.perf_counter()
    data = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (2, 3):
            (Path(tmp) / str(world)).mkdir()
            r = spawn("benchmarks.measures.qgz:_worker_qgz", world, Path(tmp) / str(world))[0]
            fp32 = r["fp32"]
            late = {k: statistics.fmean(fp32[k]["losses"][15:20]) for k in ("default", "float8")}
            data[f"ranks{world}"] = {
                "steps": len(fp32["default"]["losses"]),
                "shard_rows_rank0": r["shard_rows"],
                "bytes_fp32_reduce_scatter": fp32["default"]["bytes"]["reduce_scatter_single"],
                "bytes_bf16_reduce_scatter": r["bf16"]["default"]["bytes"]["reduce_scatter_single"],
                "bytes_float8_all_to_all": fp32["float8"]["bytes"]["all_to_all_single"],
                "grad_sqnr_db": {
                    v: q._grad_sqnr(r[v]) for v in r if isinstance(r[v], dict) and "float8" in r[v]
                },
                "late_loss": late,
                "late_loss_gap": late["float8"] / late["default"] - 1,
                # the best of the timed steps: on a shared machine the median moves with load
                "backward_ms_best": {
                    k: 1000 * min(fp32[k]["backward_s"]) for k in ("default", "float8")
                },
                "backward_steps_timed": len(fp32["default"]["backward_s"]),
            }
    write(
        "qgz",
        [
            *MEASURES["qgz"],
            "float8kit/distributed/reduce_scatter.py",
        ],
        data,
        time.perf_counter() - t0,
    )


def qgz_train() -> None:
    """recipes/train.py on 2 gloo processes (torchrun), --float8 tensorwise, with and without
    --float8-reduce-scatter, tiny and small presets (their default steps), plus the default
    run with --seed 1 for the seed noise. Losses as compare.py summarizes them; tokens/s the
    median after the first 3 steps."""
    import compare

    t0 = time.perf_counter()
    data = {}
    for preset in ("tiny", "small"):
        runs = {}
        for name, flags in (
            ("default", []),
            ("float8_reduce_scatter", ["--float8-reduce-scatter"]),
            ("default_seed1", ["--seed", "1"]),
        ):
            out = RUNS / "qgz_train" / f"{preset}_{name}"
            run(
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                "recipes/train.py",
                "--preset",
                preset,
                "--float8",
                "tensorwise",
                "--quiet",
                "--overwrite",
                "--out",
                str(out.relative_to(REPO)),
                *flags,
            )
            recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            # compare.py reports no speed (its runs overlap); these run one at a time: the
            # median tokens/s after the first 3 steps (warm-up)
            speed = statistics.median(r["tokens_per_s"] for r in recs[3:])
            runs[name] = {**compare.summarize(recs), "tokens_per_s": speed}
        ref = runs["default"]
        data[preset] = {
            "runs": runs,
            **{
                f"{which}_pct": {
                    k: 100 * (runs[other][k] - ref[k]) / ref[k] for k in ("train_loss", "val_loss")
                }
                for which, other in (("gap", "float8_reduce_scatter"), ("noise", "default_seed1"))
            },
        }
    write(
        "qgz_train",
        ["recipes/train.py", "recipes/cli.py", "recipes/compare.py", "recipes/model.py"]
        + ["recipes/data.py", "recipes/corpus", "float8kit/distributed/reduce_scatter.py"],
        data,
        time.perf_counter() - t0,
    )


def tp() -> None:
    """benchmarks/measures/tp.py's multi-process runs (2 and 4 gloo ranks); rank 0's numbers."""
    from benchmarks.measures import tp as t
    from benchmarks.measures.gloo import _rel_diff, spawn

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for sub in ("tp2", "mesh2d"):
            (tmp / sub).mkdir()
        r = spawn("benchmarks.measures.tp:_worker_tp2", 2, tmp / "tp2")[0]
        m = spawn("benchmarks.measures.tp:_worker_2d", 4, tmp / "mesh2d")
    sp = ("tensorwise", "rowwise")
    data = {
        "torch_styles_rel_diff": {
            recipe: _rel_diff(r[f"tp_{recipe}"], r[f"ref_{recipe}"]) for recipe in t.RECIPES
        },
        "sp_rel_diff": {
            recipe: _rel_diff(r[f"fp8_sp_{recipe}"], r[f"ref_{recipe}"]) for recipe in sp
        },
        "sp_equals_torch_sp": {
            recipe: r[f"fp8_sp_{recipe}"] == r[f"torch_sp_{recipe}"] for recipe in sp
        },
        "all_gather_bytes_fp8": {recipe: r[f"bytes_fp8_sp_{recipe}"] for recipe in sp},
        "all_gather_bytes_bf16": {recipe: r[f"bytes_torch_sp_{recipe}"] for recipe in sp},
        "compiled_equals_eager": r["compiled_fp8_sp_tensorwise"] == r["fp8_sp_tensorwise"],
        "compiled_llama_rel_diff": {
            recipe: _rel_diff(r[f"compiled_llama_{recipe}"], r[f"eager_llama_{recipe}"])
            for recipe in sp
        },
        "compiled_llama_graph_breaks": {recipe: r[f"graph_breaks_{recipe}"] for recipe in sp},
        "mesh2d_rel_diff": {
            recipe: max(_rel_diff(x[f"2d_{recipe}"], m[0][f"ref_{recipe}"]) for x in m)
            for recipe in sp
        },
        "mesh2d_fsdp_float8_all_gather": {
            recipe: m[0][f"fp8_all_gather_{recipe}"] for recipe in sp
        },
        "dcp_resume_bitwise": all(x["resumed"] == x["after"] for x in m),
        "mlp": {"dim": t.DIM, "hidden": t.HIDDEN, "batch": t.BATCH, "seq": t.SEQ, "steps": t.STEPS},
        "llama": {"preset": "tiny", "seq": t.LLAMA_SEQ, "steps": t.LLAMA_STEPS},
    }
    write(
        "tp",
        [*MEASURES["tp"], "recipes/model.py"],
        data,
        time.perf_counter() - t0,
    )


# ---------------------------------------------------------------------------- benchmarks


def bench(script: str, out: str, *args: str) -> None:
    """A benchmark script writes numbers/OUT.json (and .md) itself; we add its wall time."""
    wall = run(f"benchmarks/{script}.py", *args, "--out", f"numbers/{out}.json")
    path = NUMBERS / f"{out}.json"
    path.write_text(
        json.dumps(
            {**json.loads(path.read_text()), "wall_s": round(wall, 1)}, indent=2, allow_nan=False
        )
        + "\n"
    )


def bench_overhead() -> None:
    bench(
        "bench_overhead",
        "bench_overhead",
        "--threads",
        "1",
        "--recipes",
        "tensorwise,rowwise,rowwise_with_gw_hp",
        "--profile",
    )


def bench_overhead_compiled() -> None:
    bench(
        "bench_overhead",
        "bench_overhead_compiled",
        "--threads",
        "1",
        "--compile",
        "--recipes",
        "tensorwise,rowwise,rowwise_with_gw_hp",
    )


def bench_comm() -> None:
    bench("bench_comm", "bench_comm_tiny")
    bench("bench_comm", "bench_comm_small", "--preset", "small")


def bench_linear() -> None:
    bench(
        "bench_linear",
        "bench_linear",
        "--device",
        "cpu",
        "--shapes",
        "small",
        "--no-compile",
        "--threads",
        "1",
    )


def roofline() -> None:  # reads bench_linear's file: run after it
    bench("roofline", "roofline", "--threads", "1", "--linear-json", "numbers/bench_linear.json")


def traffic() -> None:
    """Bytes and kernels outside the gemms of one compiled Linear per recipe, float8kit vs
    torchao vs the minimum (benchmarks/bench_traffic.py, from inductor's scheduler)."""
    wall = run("benchmarks/bench_traffic.py", "--json", "numbers/traffic.json")
    path = NUMBERS / "traffic.json"
    path.write_text(
        json.dumps(
            {**json.loads(path.read_text()), "wall_s": round(wall, 1)}, indent=2, allow_nan=False
        )
        + "\n"
    )


# the torchao.float8 README's shapes (H100): 1024x2048x1024 measured 0.80x and
# 4096x8192x16384 1.39x for tensorwise; the ones between fill in the curve
SEED_SHAPES = [
    (1024, 2048, 1024),
    (2048, 4096, 2048),
    (4096, 4096, 4096),
    (4096, 8192, 8192),
    (4096, 8192, 16384),
]
SEED_MEASURED = {(1024, 2048, 1024): 0.80, (4096, 8192, 16384): 1.39}


def roofline_predicted() -> None:
    """float8kit.roofline's predicted fwd+bwd speedup per torchao.float8 README shape, recipe
    and device (uncalibrated efficiencies), and where auto_module_filter and torchao's
    _auto_filter_for_recipe disagree."""
    from torch import nn

    from float8kit import roofline

    t0 = time.perf_counter()
    rows = []
    for device in roofline.DEVICES:
        for recipe in roofline.TRAFFIC:
            for m, k, n in SEED_SHAPES:
                p = roofline.predict(m, k, n, recipe, device)
                rows.append(
                    {
                        "device": device,
                        "recipe": recipe,
                        "shape": [m, k, n],
                        "speedup": round(p["speedup"], 4),
                        "bf16_ms": round(p["bf16_ms"], 5),
                        "float8_ms": round(p["float8_ms"], 5),
                        "traffic_ms": round(p["traffic_ms"], 5),
                        "seed_measured": SEED_MEASURED.get((m, k, n))
                        if (device, recipe) == ("h100", "tensorwise")
                        else None,
                    }
                )
    ao_float8, _ = common.import_torchao_float8()
    filters = []
    dims = [1024, 2048, 4096, 8192, 16384]
    for recipe in ("tensorwise", "rowwise"):
        ao = ao_float8._auto_filter_for_recipe(recipe, filter_fqns=[])
        for tokens in (4096, 16384):
            ours = roofline.auto_module_filter(recipe, device="h100", tokens=tokens)
            for k in dims:
                for n in dims:
                    lin = nn.Linear(k, n, bias=False, device="meta")
                    filters.append(
                        {
                            "recipe": recipe,
                            "tokens": tokens,
                            "K": k,
                            "N": n,
                            "float8kit": ours(lin, "layer"),
                            "torchao": ao(lin, "layer"),
                            "speedup": round(roofline.predicted_speedup(tokens, k, n, recipe), 4),
                        }
                    )
    eff = roofline.Efficiency()
    write(
        "roofline_predicted",
        ["float8kit/roofline.py"],
        {
            "devices": {k: dataclasses.asdict(v) for k, v in roofline.DEVICES.items()},
            "efficiency": dataclasses.asdict(eff),
            "traffic": {k: dataclasses.asdict(v) for k, v in roofline.TRAFFIC.items()},
            "rows": rows,
            "filters": filters,
        },
        time.perf_counter() - t0,
    )


def bench_train() -> None:
    bench(
        "bench_train",
        "bench_train",
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--no-compile",
        "--threads",
        "1",
    )
    bench(
        "bench_train",
        "bench_train_compiled",
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--compile",
        "--threads",
        "1",
        "--recipes",
        "tensorwise",
        "--warmup",
        "2",
        "--steps",
        "5",
    )


def optim() -> None:
    """benchmarks/measures/optim.py: float8kit.optim's AdamW8bit and AdamW4bit beside fp32
    AdamW (torch's) and torchao.optim's classes of the same names: state bytes per parameter
    (1M-parameter MLP), the fixed task's last-20-step loss over 3 seeds, the total update's
    SQNR after 20 steps and the step time, the FSDP2 update against one device on 2 and 3
    gloo ranks (torchao's too), and float8 all-gather training on 2 ranks."""
    import statistics

    from benchmarks.measures import optim as o
    from benchmarks.measures.gloo import spawn

    t0 = time.perf_counter()
    data: dict = {"fp32_bytes_per_param": o.bytes_per_param("adamw"), "seeds": 3}
    refs = [o.tail_mean(o.train_task("adamw", seed)) for seed in range(data["seeds"])]
    for lib in ("float8kit", "torchao"):
        for name in o.LOW_BIT:
            key = f"{lib}_{name}"
            print("+", key, flush=True)
            gaps = [
                o.tail_mean(o.train_task(name, seed, lib=lib)) / ref - 1
                for seed, ref in enumerate(refs)
            ]
            row: dict = {"train_gap_mean": statistics.fmean(gaps)}
            row["train_gap_max_abs"] = max(abs(g) for g in gaps)
            row |= o.update_vs_fp32(name, lib)  # and the state bytes per parameter
            data[key] = row
    with tempfile.TemporaryDirectory() as tmp:
        for world in (2, 3):
            for lib, worker in (("float8kit", "mesh_worker"), ("torchao", "torchao_mesh_worker")):
                folder = Path(tmp) / f"{lib}{world}"
                folder.mkdir()
                try:
                    results = spawn(f"benchmarks.measures.optim:{worker}", world, folder)
                except Exception as e:  # torchao's ranks crash on CPU at 3 (uneven shards)
                    if lib == "float8kit":
                        raise
                    error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
                    results = [dict.fromkeys(o.LOW_BIT, error)]
                for name in o.LOW_BIT:
                    ref = o.one_device(name, lib=lib)
                    data[f"{lib}_{name}"][f"mesh{world}"] = o.mesh_check(results, name, ref)
        (Path(tmp) / "float8").mkdir()
        losses = spawn("benchmarks.measures.optim:float8_worker", 2, Path(tmp) / "float8")[0]
    ref = o.tail_mean(losses["adamw"], 10)
    data["float8_all_gather_gap"] = {
        name: o.tail_mean(losses[name], 10) / ref - 1 for name in o.LOW_BIT
    }
    sources = [f"{_M}/optim.py", f"{_M}/gloo.py", f"{_M}/refs.py", "benchmarks/common.py"]
    write("optim", sources, data, time.perf_counter() - t0)


def cpu_dtype() -> None:
    """A bf16 and an fp32 matmul on this CPU, natively and as on an AVX2-only CPU (oneDNN
    capped): why CPU runs compute in fp32 where bf16 is not native."""
    script = "benchmarks/measures/cpu_dtype.py"
    data, wall = {}, 0.0
    with avx2_env() as capped:
        for kind, env in (("native", ENV), ("avx2", {**ENV, **capped})):
            t0 = time.perf_counter()
            out = subprocess.run(
                [PY, script], cwd=REPO, env=env, check=True, capture_output=True, text=True
            )
            wall += time.perf_counter() - t0
            data[kind] = json.loads(out.stdout)
    write("cpu_dtype", [script], data, wall)


# The two suite timings cannot pass their own freshness test while they are measured: each
# deselects both files' (the later one's file is stale while the first runs), and every later
# suite run checks them.
SUITE_FILES = ("suite.json", "suite_avx2.json")


def _suite(name: str, env: dict[str, str] | None = None, **extra) -> None:
    """Run the suite (``env`` added to its environment); publish its wall time and counts as
    ``name``, never for a red suite. Re-renders the docs first: a number file written since
    the last rendering (the other suite's included) would fail the suite's docs tests."""
    import xml.etree.ElementTree as ET

    run("tools/publish.py")

    own = "tests/test_docs.py::test_number_file_names_a_clean_commit_that_has_its_scripts"
    deselect = [a for f in SUITE_FILES for a in ("--deselect", f"{own}[{f}]")]
    # make test's workers: the Makefile's WORKERS
    found = re.search(r"^WORKERS \?= (\d+)$", (REPO / "Makefile").read_text(), re.M)
    if found is None:
        raise SystemExit(
            "tools/measure.py suite: the Makefile has no 'WORKERS ?= N' line (make test's "
            "pytest workers), so the published time could not be make test's: restore it"
        )
    workers = found[1]
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "junit.xml"
        args = ("-q", "-n", workers, "--dist", "loadfile", "-p", "no:cacheprovider")
        args += (f"--junitxml={report}", *deselect)
        # a cold inductor cache, as on a fresh machine (avx2_env brings its own)
        env = {"TORCHINDUCTOR_CACHE_DIR": str(Path(d) / "inductor"), **(env or {})}
        wall = run("-m", "pytest", *args, env=env)
        s = ET.parse(report).getroot().find("testsuite")
    tests, skipped = int(s.get("tests")), int(s.get("skipped"))
    failed = int(s.get("failures")) + int(s.get("errors"))
    assert failed == 0, f"{failed} tests failed: no suite time is published for a red suite"
    data = {"tests": tests, "passed": tests - skipped, "skipped": skipped, "workers": int(workers)}
    data |= extra
    write(name, ["Makefile", "pyproject.toml"], data, wall, threads=DEFAULT_THREADS)


def suite() -> None:
    """`make test`'s suite: its wall time on this machine and its counts. Runs last, after
    re-rendering the docs from the files just written (tests/test_docs.py checks them), and
    refuses to publish a time for a suite that failed."""
    _suite("suite")


def suite_avx2() -> None:
    """`make test`'s suite as an AVX2-only CPU runs it (emulated here, see cpu_dtype): its
    wall time and counts."""
    with avx2_env() as env:
        _suite("suite_avx2", env, emulated_with=AVX2_ONLY)


NAMES: dict[str, Callable[[], None]] = {
    "numerics": numerics,
    "scaling": scaling,
    "outliers": outliers,
    "mx_numerics": mx_numerics,
    "nvfp4_numerics": nvfp4_numerics,
    "fsdp": fsdp,
    "fsdp_blockwise": fsdp_blockwise,
    "fsdp_mx": fsdp_mx,
    "fsdp_nvfp4": fsdp_nvfp4,
    "expert_parallel": expert_parallel,
    "moe_tiny_ep": moe_tiny_ep,
    "moe_tiny_dp2": moe_tiny_dp2,
    "fsdp_mesh": fsdp_mesh,
    "qgz": qgz,
    "qgz_train": qgz_train,
    "memory": memory,
    "monitor": monitor,
    "memory_blocks": memory_blocks,
    "memory_compiled": memory_compiled,
    "experts": experts,
    "moe_hf": moe_hf,
    "tp": tp,
    "tiny": tiny,
    "moe_tiny": moe_tiny,
    "nvfp4_small": nvfp4_small,
    "demo": demo,
    "demo_busy": demo_busy,
    "demo_avx2": demo_avx2,
    "bench_overhead": bench_overhead,
    "bench_overhead_compiled": bench_overhead_compiled,
    "bench_comm": bench_comm,
    "bench_linear": bench_linear,
    "roofline": roofline,
    "traffic": traffic,
    "roofline_predicted": roofline_predicted,
    "bench_train": bench_train,
    "optim": optim,
    "optim_small_adamw8bit": optim_small("adamw8bit"),
    "optim_small_adamw4bit": optim_small("adamw4bit"),
    "cpu_dtype": cpu_dtype,
    "suite": suite,
    "suite_avx2": suite_avx2,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"what to measure (default: all, in this order): {', '.join(NAMES)}",
    )
    p.add_argument(
        "--allow-dirty",
        action="store_true",
        help="measure a checkout with uncommitted changes (the files say so, and "
        "tests/test_docs.py refuses them)",
    )
    args = p.parse_args()
    if unknown := [n for n in args.names if n not in NAMES]:
        p.error(f"unknown NAME {', '.join(unknown)}; choose from {', '.join(NAMES)}")
    if common.git_dirty() and not args.allow_dirty:
        p.error(
            "uncommitted changes outside numbers/ and *.md: commit them first, so that "
            "every number names the code that made it (or pass --allow-dirty to try)"
        )
    torch.set_num_threads(1)
    NUMBERS.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    for name in args.names or NAMES:
        NAMES[name]()
    print(f"done in {time.perf_counter() - t0:.0f} s; now run: python tools/publish.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
