"""Where one compiled Linear training step spends its time, bf16 vs float8kit vs torchao, from
torch.profiler's trace: the step a loop with a ``loss.item()`` sees (a synchronize after each).

The host-bound shape: on the H200 the compiled tensorwise step at 8192x4096x4096 ran
slower than torchao's, synchronized per step (docs/gpu.md), although both libraries run the
same three gemms and float8kit moves fewer bytes. This names where the difference is. For
the bf16 layer, and float8kit's and torchao's layers for each of ``--recipes``, it compiles
the layer, runs ``--warmup`` steps, then profiles ``--steps`` steps (forward, backward with
input grads, ``precompute_scales`` for float8kit, a synchronize; each inside one
``record_function``) and reads the exported Chrome trace (its ``cat`` field names kernels,
memcpys, runtime calls and annotations alike on every torch since 2.11). Per step, medians
over the profiled steps:

- ``wall_us``: the step's range on the host, synchronize included;
- ``busy_us``: the union of the device's kernel/memcpy/memset intervals inside it;
  ``idle_us`` = wall - busy (what a faster host would win back);
- ``first_kernel_us`` / ``first_gemm_us``: from the step's start to the first device
  activity / the first gemm kernel (host time before the GPU has work);
- ``launches``: kernel launch calls on the host; ``kernels``: device kernels;
- ``top``: the device kernels by time per step (name, calls, us).

On a machine without a GPU (the dry run) only the host columns are filled. Writes
``runs/benchmarks/<date>-<device>-step_profile.json`` (``--out``) and its ``.md``; the Chrome
traces beside it with ``--traces``.

    python benchmarks/bench_step_profile.py --shape 8192x4096x4096 --recipes tensorwise,delayed
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from pathlib import Path

import bench_linear
import common
import torch

STEP = "bench_step_profile.step"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# cuBLAS(Lt) / CUTLASS gemm kernels (sm90 float8 gemms are nvjet_* or cutlass/xmma ones)
GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|_scaled_mm", re.IGNORECASE)
# launches through the runtime (cuBLAS, aten: cudaLaunchKernel[ExC]) or the driver (Triton:
# cuLaunchKernel[Ex])
LAUNCH, LAUNCH_CATS = re.compile(r"^cu(da)?LaunchKernel"), ("cuda_runtime", "cuda_driver")


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def read_trace(trace: dict, gpu: bool) -> list[dict]:
    """Per profiled step: its host range and what ran inside it (see the module docstring);
    the device columns None without a GPU."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e["name"] == STEP and e.get("cat") == "user_annotation"
    )
    out = []
    for start, end in steps:
        inside = [e for e in events if start <= e["ts"] < end]
        device = [e for e in inside if e.get("cat") in DEVICE_CATS]
        kernels = [e for e in device if e["cat"] == "kernel"]
        gemms = [e["ts"] for e in kernels if GEMM.search(e["name"])]
        top: dict[str, list[float]] = {}
        for e in kernels:
            top.setdefault(e["name"], []).append(e["dur"])
        busy = _union([(e["ts"], min(e["ts"] + e["dur"], end)) for e in device])
        out.append(
            {
                "wall_us": end - start,
                "busy_us": busy if gpu else None,
                "idle_us": end - start - busy if gpu else None,
                "first_kernel_us": min(e["ts"] for e in device) - start if device else None,
                "first_gemm_us": min(gemms) - start if gemms else None,
                "launches": sum(
                    1 for e in inside if e.get("cat") in LAUNCH_CATS and LAUNCH.search(e["name"])
                ),
                "kernels": len(kernels),
                "top": {n: (len(d), sum(d)) for n, d in top.items()},
            }
        )
    return out


def summarize(steps: list[dict], n_top: int) -> dict:
    """Medians over the profiled steps; the top kernels by their time per step (the mean over
    the profiled steps)."""

    def med(key):
        vals = [s[key] for s in steps if s[key] is not None]
        return round(statistics.median(vals), 1) if vals else None

    keys = ("wall_us", "busy_us", "idle_us", "first_kernel_us", "first_gemm_us")
    row = {k: med(k) for k in keys}
    row["launches"] = statistics.median(s["launches"] for s in steps)
    row["kernels"] = statistics.median(s["kernels"] for s in steps)
    totals: dict[str, list[float]] = {}
    for s in steps:
        for name, (calls, us) in s["top"].items():
            totals.setdefault(name, [0, 0.0])
            totals[name][0] += calls
            totals[name][1] += us
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:n_top]
    row["top"] = [
        {
            "kernel": name[:120].replace("|", "/"),
            "calls": c / len(steps),
            "us": round(t / len(steps), 1),
        }
        for name, (c, t) in ranked
    ]
    return row


def profile_layer(module, x, go, precompute, steps: int, trace_path: Path) -> list[dict]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if x.is_cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            with torch.profiler.record_function(STEP):
                bench_linear.train_step(module, x, go, precompute)
                common.sync(x.device)
    prof.export_chrome_trace(str(trace_path))
    return read_trace(json.loads(trace_path.read_text()), x.is_cuda)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="8192x4096x4096", help="M x K x N (tokens x in x out)")
    p.add_argument(
        "--recipes",
        default="tensorwise,delayed",
        help="comma list of float8kit recipes (each with torchao's, where torchao has it)",
    )
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (compiles on the first)")
    p.add_argument("--steps", type=int, default=10, help="profiled steps")
    p.add_argument("--top", type=int, default=12, help="kernels listed per library")
    p.add_argument("--traces", action="store_true", help="keep the Chrome traces beside --out")
    p.add_argument("--out", type=Path, default=None, help="JSON path (.md beside it)")
    p.add_argument("--threads", type=int, default=None, help=common.THREADS_HELP)
    args = p.parse_args()

    import float8kit

    common.set_threads(args.threads)
    device = common.pick_device(args.device)
    m, k, n = (int(v) for v in args.shape.split("x"))
    out = args.out or common.default_out(device, "step_profile")
    torch.manual_seed(0)
    base = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    ao_float8, _ = common.import_torchao_float8()  # (None, why) where torchao is missing
    todo = [("bf16", "bf16", base)]
    for recipe in args.recipes.split(","):
        made = bench_linear.make_layers(base, recipe, ao_float8)
        todo += [(impl, recipe, made[impl]) for impl in ("float8kit", "torchao")]
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    rows, skipped = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for impl, recipe, layer in todo:
            if isinstance(layer, str):
                skipped[f"{impl} {recipe}"] = layer
                continue
            precompute = float8kit.precompute_scales if impl == "float8kit" else None
            compiled = torch.compile(layer)
            for _ in range(args.warmup):
                bench_linear.train_step(compiled, x, go, precompute)
            common.sync(device)
            name = f"{out.stem}-{impl}-{recipe}.trace.json"
            trace = (out.parent if args.traces else Path(tmp)) / name
            trace.parent.mkdir(parents=True, exist_ok=True)
            steps = profile_layer(compiled, x, go, precompute, args.steps, trace)
            if not steps:
                raise SystemExit(f"bench_step_profile: no {STEP} range in the {name} trace")
            row = {"impl": impl, "recipe": recipe, "M": m, "K": k, "N": n}
            rows.append({**row, **summarize(steps, args.top)})
    payload = {**common.run_info(device), "kind": "step_profile", "rows": rows, "skipped": skipped}
    cols = [
        ("impl", "library"),
        ("recipe", "recipe"),
        ("wall_us", "step us"),
        ("busy_us", "GPU busy us"),
        ("idle_us", "GPU idle us"),
        ("first_kernel_us", "to first kernel us"),
        ("first_gemm_us", "to first gemm us"),
        ("launches", "launches"),
        ("kernels", "kernels"),
    ]
    table = common.markdown_table(rows, cols, ndigits=1)
    for r in rows:
        table += f"\n\n{r['impl']} {r['recipe']}, kernels by time per step:\n\n"
        table += common.markdown_table(
            r["top"], [("kernel", "kernel"), ("calls", "calls"), ("us", "us")], ndigits=1
        )
    json_path, md_path = common.write_results(
        out, payload, table, f"Compiled step profile, {args.shape}"
    )
    print(table)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
