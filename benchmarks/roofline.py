"""Predicted float8 speedup per Linear shape, from gemm rates, cast bytes and bandwidth.

The model (dynamic tensorwise, eager, as float8kit runs it), for one Linear (M, K, N):

    work_bf16 = g * 2MKN / R_bf16
    work_fp8  = g * 2MKN / R_fp8 + cast_bytes / BW
    CPU:  t = T0 + work          (one processor does the Python and the math, in turn)
    CUDA: t = max(T0, work)      (the host queues kernels while the GPU runs earlier ones)

g = gemms (3 for fwd_bwd, 1 for fwd). cast_bytes counts what the casts move beyond the gemms:
per operand element an amax read (2 B of bf16) and a cast (read 2 B, write 1 B of fp8), and in
fwd_bwd one fp8 transpose copy for the operand's second gemm (read 1 B, write 1 B): 7 B per
element of input (MK), weight (KN) and grad_output (MN) for fwd_bwd, 5 B for input and
weight in fwd. T0 is the fixed per-call cost (Python, dispatch, kernel launches), measured
as the fwd(+bwd) time of a 16x16x16 layer. Big shapes approach R_fp8 / R_bf16 (less the cast
traffic, which shrinks relative to flops as 1/size); small shapes lose to T0 and the casts:
that is the crossover the default module filter and bench_linear have to find. The model
ignores what a compiled graph would fuse (amax+cast in one pass: fewer bytes, smaller T0).

Measured rates (this machine: bf16 ``mm`` and the fp8 gemm float8kit runs at --measure-size,
copy bandwidth, T0 of bf16 and float8kit layers), optionally beside bench_linear's measured
speedups:

    python benchmarks/roofline.py --threads 1 --linear-json numbers/bench_linear.json
    python benchmarks/roofline.py --device cuda --measure-size 8192      # on an H100

A MODEL with datasheet-style H100 constants (not a
measurement, labeled so in every output):

    python benchmarks/roofline.py --device-spec h100

Writes ``runs/benchmarks/<date>-<device>-roofline.json`` (+ ``.md``) with ``device, torch,
torchao, date, command, rows``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import common
import torch
from bench_linear import SHAPE_SETS, parse_shapes
from torch import nn

# ----------------------------------------------------------------------------
# device specs: a MODEL, not a measurement

# Dense rates a well-shaped gemm achieves on an H100 SXM (not the sparse datasheet peaks),
# HBM3 bandwidth achieved by a streaming copy, and ~6 us of eager PyTorch per op (CPU-side
# dispatch, which hides the GPU launch) times the ops one layer call runs.
DEVICE_SPECS = {
    "h100": dict(bf16_tflops=800.0, fp8_tflops=1450.0, bw_tbps=3.0, us_per_op=6.0),
}


# ----------------------------------------------------------------------------
# measurements on this machine


def tiny_layers(device, k: int = 16, n: int = 16) -> dict[str, nn.Module]:
    import float8kit

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(k, n, bias=False)).to(device=device, dtype=torch.bfloat16)
    fp8 = float8kit.convert_to_float8_training(
        nn.Sequential(nn.Linear(k, n, bias=False)).to(device=device, dtype=torch.bfloat16),
        config=float8kit.Float8LinearConfig.from_recipe_name("tensorwise"),
    )
    fp8.load_state_dict(base.state_dict())
    return {"bf16": base, "fp8": fp8}


def measure(device, size: int, bw_mib: int, warmup: int, iters: int) -> dict:
    """Gemm rates at size^3, copy bandwidth, and fixed per-call cost of a 16^3 layer."""
    med = lambda fn: common.median(common.time_ms(fn, device, warmup=warmup, iters=iters))  # noqa: E731
    flops = 2 * size**3
    a = [torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2)]
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    bf16_ms = med(lambda i: torch.mm(a[i % 2], b))
    a8 = [t.to(torch.float8_e4m3fn) for t in a]
    b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major, as _scaled_mm wants
    one = torch.tensor(1.0, device=device)
    # the kernel float8kit runs: on CPU its own op (torch's kernel with oneDNN off for the
    # call, float8kit/gemm.py), on CUDA torch._scaled_mm
    if device.type == "cpu":
        import float8kit.gemm  # noqa: F401  (registers float8kit::cpu_scaled_mm)

        fp8_ms = med(
            lambda i: torch.ops.float8kit.cpu_scaled_mm(
                a8[i % 2], b8, one, one, torch.bfloat16, False
            )
        )
    else:
        fp8_ms = med(
            lambda i: torch._scaled_mm(
                a8[i % 2], b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16
            )
        )
    nbytes = bw_mib * 2**20
    src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    copy_ms = med(lambda i: dst.copy_(src))
    x = torch.randn(16, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(16, 16, device=device, dtype=torch.bfloat16)
    t0 = {}
    for name, mod in tiny_layers(device).items():

        def fwd(i, mod=mod):
            mod(x)

        def fwd_bwd(i, mod=mod):
            mod(x).backward(go)
            x.grad = None
            mod[0].weight.grad = None

        t0[name] = {"fwd": med(fwd) * 1e3, "fwd_bwd": med(fwd_bwd) * 1e3}
    return {
        "source": "measured",
        "host_overlaps_device": device.type == "cuda",
        "measure_size": size,
        "bf16_tflops": flops / bf16_ms / 1e9,
        "fp8_tflops": flops / fp8_ms / 1e9,
        "bw_tbps": 2 * nbytes / copy_ms / 1e9,
        "t0_us": t0,
    }


def spec(name: str) -> dict:
    s = DEVICE_SPECS[name]
    t0 = {}
    for lib, mod in tiny_layers(torch.device("cpu")).items():
        t0[lib] = {
            mode: common.count_aten_ops(mod, 16, 16, 16, mode == "fwd_bwd") * s["us_per_op"]
            for mode in ("fwd", "fwd_bwd")
        }
    return {
        "source": f"MODEL: {name} datasheet-style constants, NOT a measurement",
        "host_overlaps_device": True,
        **{k: v for k, v in s.items() if k != "us_per_op"},
        "us_per_op": s["us_per_op"],
        "t0_us": t0,
    }


# ----------------------------------------------------------------------------
# the model


def predict(m: int, k: int, n: int, mode: str, r: dict) -> dict:
    gemms = 3 if mode == "fwd_bwd" else 1
    flops = gemms * 2 * m * k * n
    cast_bytes = 7 * (m * k + k * n + m * n) if mode == "fwd_bwd" else 5 * (m * k + k * n)
    combine = max if r["host_overlaps_device"] else (lambda a, b: a + b)
    bf16_ms = combine(r["t0_us"]["bf16"][mode] / 1e3, flops / (r["bf16_tflops"] * 1e9))
    gemm8_ms = flops / (r["fp8_tflops"] * 1e9)
    cast_ms = cast_bytes / (r["bw_tbps"] * 1e9)
    fp8_ms = combine(r["t0_us"]["fp8"][mode] / 1e3, gemm8_ms + cast_ms)
    return {
        "gflop": round(flops / 1e9, 4),
        "cast_mb": round(cast_bytes / 1e6, 3),
        "bf16_pred_ms": round(bf16_ms, 5),
        "fp8_gemm_ms": round(gemm8_ms, 5),
        "cast_ms": round(cast_ms, 5),
        "fp8_pred_ms": round(fp8_ms, 5),
        "predicted_speedup": round(bf16_ms / fp8_ms, 4),
    }


def measured_speedups(path: Path | None, recipe: str) -> dict:
    """(M, K, N, mode) -> bench_linear's measured speedups (eager rows; compiled if present)."""
    if path is None:
        return {}
    data = json.loads(Path(path).read_text())
    got = {}
    for row in sorted(data["rows"], key=lambda r: r.get("compiled", False)):  # compiled wins
        if row["recipe"] == recipe:
            got[(row["M"], row["K"], row["N"], row["mode"])] = row
    return got


# ----------------------------------------------------------------------------
# main


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shapes",
        default="small,llama,square",
        help="comma list of shape sets (" + ", ".join(SHAPE_SETS) + ") and/or MxKxN",
    )
    p.add_argument("--modes", default="fwd_bwd,fwd", help="comma list of fwd_bwd, fwd")
    p.add_argument("--device", default="auto", help="where to measure rates: cuda, cpu, auto")
    p.add_argument(
        "--device-spec",
        choices=sorted(DEVICE_SPECS),
        default=None,
        help="use datasheet-style constants instead of measuring (a MODEL)",
    )
    p.add_argument(
        "--measure-size",
        type=int,
        default=None,
        help="gemm size for the rate measurement (default 8192 CUDA, 512 CPU)",
    )
    p.add_argument(
        "--bw-mib",
        type=int,
        default=None,
        help="copy size for the bandwidth measurement (default 1024 CUDA, 128 CPU)",
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed calls (default 5 CUDA, 2 CPU)")
    p.add_argument("--iters", type=int, default=None, help="timed calls (default 20 CUDA, 7 CPU)")
    p.add_argument(
        "--linear-json",
        type=Path,
        default=None,
        help="a bench_linear JSON: show its measured speedups beside the prediction",
    )
    p.add_argument(
        "--recipe",
        default="tensorwise",
        help="bench_linear recipe whose measured rows to show (the model is tensorwise)",
    )
    p.add_argument("--threads", type=int, default=None, help=common.THREADS_HELP)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default runs/benchmarks/<date>-<device>-roofline.json)",
    )
    args = p.parse_args()

    common.set_threads(args.threads)
    device = common.pick_device(args.device)
    on_cuda = device.type == "cuda"
    info = common.run_info(device)
    if args.device_spec:
        rates = spec(args.device_spec)
        info["device"] = (
            f"MODEL {args.device_spec} (datasheet-style constants, not measured; "
            f"computed on {info['device']})"
        )
        slug = f"{args.device_spec}-model"
    else:
        rates = measure(
            device,
            args.measure_size or (8192 if on_cuda else 512),
            args.bw_mib or (1024 if on_cuda else 128),
            args.warmup if args.warmup is not None else (5 if on_cuda else 2),
            args.iters if args.iters is not None else (20 if on_cuda else 7),
        )
        slug = common.device_slug(device)
    print(f"# {info['device']}\n# rates: " + json.dumps(rates), flush=True)

    shapes = list(
        {
            (m, k, n): (label, m, k, n) for label, m, k, n in reversed(parse_shapes(args.shapes))
        }.values()
    )  # one row per (M, K, N)
    seen = measured_speedups(args.linear_json, args.recipe)
    rows = []
    for mode in [m.strip() for m in args.modes.split(",")]:
        for label, m, k, n in sorted(shapes, key=lambda s: s[1] * s[2] * s[3]):
            row = {
                "label": label,
                "M": m,
                "K": k,
                "N": n,
                "mode": mode,
                **predict(m, k, n, mode, rates),
            }
            got = seen.get((m, k, n, mode))
            if got is not None:
                row["measured_float8kit_speedup"] = got.get("float8kit_speedup")
                row["measured_torchao_speedup"] = got.get("torchao_speedup")
                row["measured_compiled"] = got.get("compiled")
            rows.append(row)
    crossover = {}
    for mode in {r["mode"] for r in rows}:
        wins = [r for r in rows if r["mode"] == mode and r["predicted_speedup"] > 1]
        crossover[mode] = (
            f"{wins[0]['M']}x{wins[0]['K']}x{wins[0]['N']} ({wins[0]['gflop']} GFLOP)"
            if wins
            else "none of these shapes"
        )
    limit = rates["fp8_tflops"] / rates["bf16_tflops"]
    payload = {
        **info,
        "kind": "roofline",
        "rates": rates,
        "recipe_modeled": "tensorwise",
        "gemm_rate_ratio_fp8_over_bf16": round(limit, 3),
        "first_predicted_win": crossover,
        "rows": rows,
    }
    columns = [
        ("label", "shape"),
        ("M", "M"),
        ("K", "K"),
        ("N", "N"),
        ("mode", "mode"),
        ("gflop", "GFLOP"),
        ("cast_mb", "cast MB"),
        ("bf16_pred_ms", "bf16 ms (pred)"),
        ("fp8_pred_ms", "fp8 ms (pred)"),
        ("cast_ms", "of which casts"),
        ("predicted_speedup", "predicted speedup"),
    ]
    if seen:
        columns += [
            ("measured_float8kit_speedup", "measured fk"),
            ("measured_torchao_speedup", "measured ao"),
        ]
    table = common.markdown_table(rows, columns, ndigits=4)
    table = (
        f"Source of rates: **{rates['source']}**. bf16 {rates['bf16_tflops']:.4g} TFLOP/s, "
        f"fp8 {rates['fp8_tflops']:.4g} TFLOP/s (ratio {limit:.3f}: the large-shape "
        f"limit), bandwidth {rates['bw_tbps']:.4g} TB/s, fixed per-call cost (us) "
        f"{json.dumps(rates['t0_us'])}. First shape predicted to win: "
        f"{json.dumps(crossover)}.\n\n" + table
    )
    out = args.out or common.default_out(device, "roofline").with_name(
        common.default_out(device, "roofline").name.replace(common.device_slug(device), slug)
    )
    json_path, md_path = common.write_results(
        out, payload, table, "roofline: predicted float8 speedup per Linear shape"
    )
    print("\n" + table)
    print(f"\nwrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
