"""One Linear layer, bf16 vs float8kit vs torchao.float8: time, speedup and SQNR per shape.

For each shape (M tokens, K in_features, N out_features), each mode (``fwd``: forward with
autograd recording; ``fwd_bwd``: forward + backward) and eager / compiled, it times a bf16
``nn.Linear``, the same layer converted by float8kit and by torchao.float8 for each recipe,
interleaved in one process. float8kit's fwd_bwd call includes ``precompute_scales`` (the
per-step scale update: a no-op for dynamic recipes, the amax-history update for delayed),
as a training step would; every layer first runs two training steps. Times are medians
after warm-up (CUDA events on GPU, ``time.perf_counter`` on CPU) over several pre-made
inputs cycled so caches do not flatter. ``--timing`` picks how calls follow each other on a
GPU: ``back_to_back`` (the host queues the next call while the GPU runs this one: throughput,
``*_ms``) and/or ``synced`` (a synchronize after every call, as a loop reading ``loss.item()``
each step: the host time before the first kernel counts, ``*_synced_ms``).
Outputs (and grad_input, grad_weight for fwd_bwd) are checked against the bf16 layer in the
same run; the row's SQNR is the worst of them, and any SQNR below --min-sqnr fails the run
(after writing the results, so the bad rows can be read).

GPU (H100), the full issue-6 sweep (Llama-3 8B/70B shapes at 4096/8192/16384 tokens plus the
four square-ish reference shapes), eager and compiled:

    python benchmarks/bench_linear.py --shapes llama,square --compile

CPU, small shapes (the published CPU table, numbers/bench_linear.json), and the CI smoke run:

    python benchmarks/bench_linear.py --device cpu --shapes small --no-compile
    python benchmarks/bench_linear.py --smoke --out /tmp/linear.json

Writes ``runs/benchmarks/<date>-<device>-linear.json`` (``--out`` to change) with
``device, torch, torchao, date, command, rows``; each row is
``{label, M, K, N, recipe, mode, compiled, bf16_ms, float8kit_ms, torchao_ms, ...}``, plus
the same table as ``.md`` and a speedup-by-shape plot as ``.png``. ``skipped`` says what did
not run and why: recipes the GPU cannot run (mxfp8 before sm100), layers kept in hp.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
from pathlib import Path

import common
import torch
from torch import nn

# ----------------------------------------------------------------------------
# shapes

# Llama-3 widths (dim, ffn_hidden, n_heads, n_kv_heads, head_dim = dim // n_heads). The
# projections are unfused, as in recipes/model.py: wq/wo (dim, dim), wk/wv (dim, kv),
# w1/w3 (dim, ffn) and w2 (ffn, dim); each distinct (K, N) is timed once.
LLAMA = {
    "8b": dict(dim=4096, ffn=14336, n_heads=32, n_kv_heads=8),
    "70b": dict(dim=8192, ffn=28672, n_heads=64, n_kv_heads=8),
}
LLAMA_TOKENS = (4096, 8192, 16384)


# --timing: how timed calls follow each other, and the suffix of their row keys
TIMINGS = {"back_to_back": "", "synced": "_synced"}

# NVFP4's elements have 4 bits: its floor (one layer measures 15-17 dB against the hp
# reference, docs/numerics.md); --min-sqnr applies to the float8 recipes
FP4_MIN_SQNR_DB = 12.0


def llama_shapes(size: str) -> list[tuple[str, int, int, int]]:
    a = LLAMA[size]
    kv = a["n_kv_heads"] * a["dim"] // a["n_heads"]
    layers = [
        ("wq|wo", a["dim"], a["dim"]),
        ("wk|wv", a["dim"], kv),
        ("w1|w3", a["dim"], a["ffn"]),
        ("w2", a["ffn"], a["dim"]),
    ]
    return [(f"{size}.{name}", m, k, n) for m in LLAMA_TOKENS for name, k, n in layers]


SHAPE_SETS: dict[str, list[tuple[str, int, int, int]]] = {
    "llama8b": llama_shapes("8b"),
    "llama70b": llama_shapes("70b"),
    "llama": llama_shapes("8b") + llama_shapes("70b"),
    # the four reference shapes (M, K, N)
    "square": [
        ("ref", 1024, 2048, 1024),
        ("ref", 4096, 8192, 16384),
        ("ref", 8192, 8192, 8192),
        ("ref", 16384, 16384, 16384),
    ],
    # CPU: sizes a laptop core finishes in seconds, still showing the trend
    "small": [("small", 128, 256, 128), ("small", 256, 512, 512), ("small", 512, 1024, 1024)],
    # CI smoke test: seconds in all
    "tiny": [("tiny", 32, 64, 32), ("tiny", 128, 256, 128)],
}


def parse_shapes(spec: str) -> list[tuple[str, int, int, int]]:
    """Comma-separated set names and/or explicit ``MxKxN`` shapes."""
    shapes = []
    for part in spec.split(","):
        part = part.strip()
        if part in SHAPE_SETS:
            shapes += SHAPE_SETS[part]
        elif part.count("x") == 2:
            m, k, n = (int(v) for v in part.split("x"))
            shapes.append(("custom", m, k, n))
        else:
            raise SystemExit(
                f"bench_linear: unknown shape {part!r}: use MxKxN or one of {', '.join(SHAPE_SETS)}"
            )
    return shapes


# ----------------------------------------------------------------------------
# the three layers and one timed call


def make_layers(base: nn.Module, recipe: str, ao_float8) -> dict[str, nn.Module | str]:
    """The bf16 layer ``base`` and its float8kit / torchao conversions (copies, same weights),
    or the error text where a library cannot build that recipe."""
    import float8kit

    layers: dict[str, nn.Module | str] = {"bf16": base}
    layers["float8kit"] = float8kit.convert_to_float8_training(
        copy.deepcopy(base), config=common.float8kit_config(recipe)
    )
    if ao_float8 is None:
        layers["torchao"] = "torchao.float8 not importable"
    else:
        try:
            cfg = common.torchao_recipe_config(ao_float8, recipe)
            layers["torchao"] = ao_float8.convert_to_float8_training(
                copy.deepcopy(base), config=cfg
            )
        except Exception as e:  # noqa: BLE001  (record the peer's refusal, keep going)
            layers["torchao"] = f"{type(e).__name__}: {e}"
    return layers


def train_step(module: nn.Module, x: torch.Tensor, go: torch.Tensor | None, precompute) -> None:
    """One forward (+ backward when ``go`` is given); grads reset so they never accumulate."""
    y = module(x)
    if go is not None:
        y.backward(go)
        x.grad = None
        for p in module.parameters():
            p.grad = None
        if precompute is not None:
            precompute(module)


def outputs_for_check(module: nn.Module, x: torch.Tensor, go: torch.Tensor, backward: bool):
    x = x.detach().clone().requires_grad_(True)
    y = module(x)
    if not backward:
        return [y.detach()]
    y.backward(go)
    (w,) = [p for p in module.parameters()]
    out = [y.detach(), x.grad.detach(), w.grad.detach()]
    w.grad = None
    return out


# ----------------------------------------------------------------------------
# main


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shapes",
        default=None,
        help="comma list of shape sets (" + ", ".join(SHAPE_SETS) + ") and/or MxKxN; "
        "default: llama,square on CUDA, small on CPU",
    )
    p.add_argument(
        "--recipes",
        default=None,
        help="comma list of recipes; default: every recipe this float8kit has "
        "(tensorwise, rowwise, rowwise_with_gw_hp, delayed, ...); also static (all three "
        "operands STATIC, scale 1)",
    )
    p.add_argument("--modes", default="fwd,fwd_bwd", help="comma list of fwd, fwd_bwd")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time torch.compile'd layers (default: on for CUDA, off for CPU, "
        "where each compile takes ~20 s)",
    )
    p.add_argument(
        "--eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the eager layers (--no-eager with --compile: compiled rows only, "
        "to split a long GPU sweep)",
    )
    p.add_argument(
        "--timing",
        default="back_to_back",
        help="comma list of back_to_back (columns *_ms) and synced (a CUDA synchronize after "
        "every call, columns *_synced_ms); on CPU every call is synchronous",
    )
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed calls (default 10 CUDA, 2 CPU)"
    )
    p.add_argument("--iters", type=int, default=None, help="timed calls (default 50 CUDA, 10 CPU)")
    p.add_argument(
        "--n-inputs",
        type=int,
        default=4,
        help="pre-made inputs cycled through (fewer when they would pass --input-budget-gib)",
    )
    p.add_argument(
        "--input-budget-gib",
        type=float,
        default=2.0,
        help="cap on memory for the rotated inputs + grad_outputs of one shape",
    )
    p.add_argument(
        "--min-sqnr",
        type=float,
        default=20.0,
        help="fail (exit 1) when any float8 output/grad SQNR vs bf16 is below this (dB)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI: tiny shapes, 1 warm-up, 3 timed calls, eager only, on CPU",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default runs/benchmarks/<date>-<device>-linear.json); "
        ".md and .png are written beside it",
    )
    p.add_argument("--threads", type=int, default=None, help=common.THREADS_HELP)
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args()

    if args.smoke:
        args.shapes = args.shapes or "tiny"
        args.device = "cpu" if args.device == "auto" else args.device
        args.compile = bool(args.compile)
        args.warmup = 1 if args.warmup is None else args.warmup
        args.iters = 3 if args.iters is None else args.iters
    common.set_threads(args.threads)
    device = common.pick_device(args.device)
    on_cuda = device.type == "cuda"
    shapes = parse_shapes(args.shapes or ("llama,square" if on_cuda else "small"))
    compile_too = args.compile if args.compile is not None else on_cuda
    passes = ([False] if args.eager else []) + ([True] if compile_too else [])
    if not passes:
        raise SystemExit("bench_linear: --no-eager needs --compile (nothing to time)")
    warmup = args.warmup if args.warmup is not None else (10 if on_cuda else 2)
    iters = args.iters if args.iters is not None else (50 if on_cuda else 10)
    modes = [m.strip() for m in args.modes.split(",")]
    timings = [t.strip() for t in args.timing.split(",")]
    for t in timings:
        if t not in TIMINGS:
            raise SystemExit(f"bench_linear: unknown --timing {t!r}: use {', '.join(TIMINGS)}")
    for m in modes:
        if m not in ("fwd", "fwd_bwd"):
            raise SystemExit(f"bench_linear: unknown mode {m!r}: use fwd, fwd_bwd")
    named = common.float8kit_recipes()
    known = named + list(common.BENCH_RECIPES)
    recipes = [r.strip() for r in args.recipes.split(",")] if args.recipes else named
    for r in recipes:
        if r not in known:
            raise SystemExit(f"bench_linear: float8kit has no recipe {r!r} here: {known}")
    # mxfp8 before sm100 (H100, H200): skipped and recorded, named or not (float8kit raises)
    recipes, skipped = common.runnable_recipes(device, recipes)
    for why in skipped:
        print(f"skipped: {why}", flush=True)

    import float8kit

    ao_float8, ao_note = common.import_torchao_float8()
    info = common.run_info(device)
    print(f"# {info['device']} | torch {info['torch']} | torchao {info['torchao']}", flush=True)
    if ao_float8 is None:
        print(f"torchao.float8 not available: {ao_note}", flush=True)

    out = args.out or common.default_out(device, "linear")
    rows: list[dict] = []

    def report(complete: bool):
        """Check the rows so far and write them (JSON + .md): after every shape, so a run
        stopped by a time limit keeps what it measured (``complete`` says whether it ended)."""
        bad = []
        for row in rows:
            if "float8kit_error" in row:
                bad.append(
                    f"{row['label']} {row['M']}x{row['K']}x{row['N']} {row['recipe']} "
                    f"{row['mode']}: float8kit failed: {row['float8kit_error']}"
                )
            fp4 = row["recipe"] == "nvfp4"
            floor = min(args.min_sqnr, FP4_MIN_SQNR_DB) if fp4 else args.min_sqnr
            for name in ("float8kit", "torchao"):
                s = row.get(f"{name}_sqnr_db", "absent")
                if s != "absent" and s is not None and s < floor:
                    bad.append(
                        f"{row['label']} {row['M']}x{row['K']}x{row['N']} {row['recipe']} "
                        f"{row['mode']}: {name} SQNR {s} dB < {floor} dB"
                    )
        payload = {
            **info,
            "kind": "linear",
            "timing": "CUDA events" if on_cuda else "perf_counter",
            "timings": timings,
            "warmup": warmup,
            "iters": iters,
            "min_sqnr_db": args.min_sqnr,
            "min_sqnr_db_nvfp4": min(args.min_sqnr, FP4_MIN_SQNR_DB),
            "recipes": recipes,
            "rows": rows,
            "skipped": skipped,
            "failures": bad,
            "complete": complete,
        }
        columns = [
            ("label", "shape"),
            ("M", "M"),
            ("K", "K"),
            ("N", "N"),
            ("recipe", "recipe"),
            ("mode", "mode"),
            ("compiled", "compiled"),
            ("bf16_ms", "bf16 ms"),
            ("float8kit_ms", "float8kit ms"),
            ("torchao_ms", "torchao ms"),
            ("float8kit_speedup", "fk speedup"),
            ("torchao_speedup", "ao speedup"),
            *(
                [
                    ("bf16_synced_ms", "bf16 ms synced"),
                    ("float8kit_synced_ms", "float8kit ms synced"),
                    ("torchao_synced_ms", "torchao ms synced"),
                    ("float8kit_synced_speedup", "fk speedup synced"),
                    ("torchao_synced_speedup", "ao speedup synced"),
                ]
                if "synced" in timings
                else []
            ),
            ("float8kit_sqnr_db", "fk SQNR dB"),
            ("torchao_sqnr_db", "ao SQNR dB"),
        ]
        table = common.markdown_table(rows, columns)
        errors = sorted(
            {
                f"- {n}: {r[f'{n}_error']}"
                for r in rows
                for n in ("torchao", "float8kit")
                if f"{n}_error" in r
            }
        )
        if errors:
            table += "\n\nErrors (recorded, not hidden):\n" + "\n".join(errors)
        json_path, md_path = common.write_results(
            out, payload, table, "bench_linear: bf16 vs float8kit vs torchao.float8, one Linear"
        )
        return table, json_path, md_path, bad

    # besides the recipes above: (shape, recipe) pairs float8kit's default filter keeps in hp
    for label, M, K, N in shapes:
        torch.manual_seed(0)
        set_bytes = 2 * (M * K + M * N)  # one bf16 input + one grad_output
        n_inputs = max(2, min(args.n_inputs, int(args.input_budget_gib * 2**30 // set_bytes)))
        xs = [
            torch.randn(M, K, device=device, dtype=torch.bfloat16).requires_grad_(True)
            for _ in range(n_inputs)
        ]
        gos = [torch.randn(M, N, device=device, dtype=torch.bfloat16) for _ in range(n_inputs)]
        # One bf16 layer per shape: every recipe converts a copy of the same weights, so the
        # bf16 time and reference outputs are shared. Sequential: converters see a child Linear.
        base = nn.Sequential(nn.Linear(K, N, bias=False)).to(device=device, dtype=torch.bfloat16)
        for compiled in passes:
            # mode -> the bf16 row entries; the bf16 layer is the same for every recipe
            bf16_ms: dict[str, dict[str, float]] = {}
            bf16_ref: dict[str, list[torch.Tensor]] = {}
            for recipe in recipes:
                config = common.float8kit_config(recipe)
                if not float8kit.default_module_filter(base[0], "0", config):
                    # e.g. blockwise below 128-multiples: the layer would stay bf16
                    skipped.append(f"{label} {M}x{K}x{N} {recipe}: kept hp by the default filter")
                    print(f"skipped: {skipped[-1]}", flush=True)
                    continue
                layers = make_layers(base, recipe, ao_float8)
                runnable = {name: mod for name, mod in layers.items() if isinstance(mod, nn.Module)}
                # Prime: two full training steps (delayed scaling fills its history here).
                for name, mod in runnable.items():
                    pre = float8kit.precompute_scales if name == "float8kit" else None
                    for i in range(2):
                        train_step(mod, xs[i % n_inputs], gos[i % n_inputs], pre)
                if compiled:
                    runnable = {name: torch.compile(mod) for name, mod in runnable.items()}
                for mode in modes:
                    backward = mode == "fwd_bwd"
                    row = dict(
                        label=label,
                        M=M,
                        K=K,
                        N=N,
                        recipe=recipe,
                        mode=mode,
                        compiled=compiled,
                        n_inputs=n_inputs,
                    )
                    for name in ("bf16", "float8kit", "torchao"):
                        if name == "bf16" and mode in bf16_ms:
                            row.update(bf16_ms[mode])
                            continue
                        mod = runnable.get(name)
                        if mod is None:
                            row[f"{name}_error"] = layers[name]
                            continue
                        pre = float8kit.precompute_scales if name == "float8kit" else None

                        def fn(i, mod=mod, pre=pre, backward=backward, xs=xs, gos=gos):
                            train_step(
                                mod, xs[i % len(xs)], gos[i % len(gos)] if backward else None, pre
                            )

                        try:
                            times = {
                                TIMINGS[t]: common.median(
                                    common.time_ms(
                                        fn, device, warmup=warmup, iters=iters, synced=t == "synced"
                                    )
                                )
                                for t in timings
                            }
                            outs = outputs_for_check(mod, xs[0], gos[0], backward)
                        except Exception as e:  # noqa: BLE001  (a peer failure is a result)
                            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                            continue
                        for suffix, ms in times.items():
                            row[f"{name}{suffix}_ms"] = round(ms, 4)
                        if name == "bf16":
                            bf16_ms[mode] = {f"bf16{x}_ms": row[f"bf16{x}_ms"] for x in times}
                            bf16_ref[mode] = outs
                        elif mode in bf16_ref:
                            pairs = zip(bf16_ref[mode], outs, strict=True)
                            row[f"{name}_sqnr_db"] = common.finite_or_none(
                                min(common.sqnr_db(r, o) for r, o in pairs)
                            )
                    for name in ("float8kit", "torchao"):
                        for x in (TIMINGS[t] for t in timings):
                            if row.get(f"{name}{x}_ms") and row.get(f"bf16{x}_ms"):
                                row[f"{name}{x}_speedup"] = round(
                                    row[f"bf16{x}_ms"] / row[f"{name}{x}_ms"], 3
                                )
                    rows.append(row)
                    print(" ".join(f"{k}={common.fmt(v)}" for k, v in row.items()), flush=True)
                del layers, runnable
                if compiled:
                    # Every layer recompiles the same Sequential.forward: without a reset,
                    # dynamo's recompile limit would silently run later shapes eagerly.
                    torch._dynamo.reset()
                gc.collect()
                if on_cuda:
                    torch.cuda.empty_cache()
        del xs, gos, base
        report(complete=False)

    table, json_path, md_path, bad = report(complete=True)
    print("\n" + table)
    print(f"\nwrote {json_path} and {md_path}")
    if not args.no_plot:
        print(f"wrote {plot(rows, json_path.with_suffix('.png'), info)}")
    if bad:
        print("\nFAILED:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


def plot(rows: list[dict], path: Path, info: dict) -> Path:
    """Speedup over bf16 by shape for the fwd_bwd rows (compiled ones when there are any)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r["mode"] == "fwd_bwd"] or rows
    if any(r["compiled"] for r in sel):
        sel = [r for r in sel if r["compiled"]]
    shapes = list(dict.fromkeys((r["label"], r["M"], r["K"], r["N"]) for r in sel))
    series = list(
        dict.fromkeys((lib, r["recipe"]) for r in sel for lib in ("float8kit", "torchao"))
    )
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(shapes) * max(1, len(series)) / 3), 4.5))
    width = 0.8 / max(1, len(series))
    for j, (lib, recipe) in enumerate(series):
        ys = []
        for s in shapes:
            match = [
                r
                for r in sel
                if (r["label"], r["M"], r["K"], r["N"]) == s and r["recipe"] == recipe
            ]
            ys.append(match[0].get(f"{lib}_speedup") or 0.0 if match else 0.0)
        recipes = list(dict.fromkeys(r for _, r in series))
        ax.bar(
            [i + j * width for i in range(len(shapes))],
            ys,
            width,
            label=f"{lib} {recipe}",
            color=f"C{recipes.index(recipe)}",
            hatch="" if lib == "float8kit" else "//",
            edgecolor="white",
        )
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
    ax.set_xticklabels(
        [f"{lab}\n{m}x{k}x{n}" for lab, m, k, n in shapes], fontsize=7, rotation=45, ha="right"
    )
    ax.set_ylabel("speedup over bf16 (fwd+bwd)")
    mode = "compiled" if sel and sel[0]["compiled"] else "eager"
    ax.set_title(f"{info['device']}, {mode}", fontsize=8)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
