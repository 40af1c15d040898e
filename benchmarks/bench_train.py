"""Training-step throughput (tokens/s) of the recipes model: bf16 vs float8kit vs torchao.

The model is ``recipes/model.py`` (Llama-style; ``--preset``), bf16 parameters, AdamW,
one device, compiled by default on CUDA. Each variant starts from the same weights and sees
the same pre-made batches (cycled); the bf16 model, then float8kit and torchao.float8 for
each recipe, converted the way the recipes do it (every block Linear; the lm head
``output`` stays bf16). Step = forward + loss + backward + optimizer step + zero_grad + the
library's scale precompute (float8kit ``precompute_scales``; a no-op for dynamic recipes).
Reported: median step time after warm-up (CUDA events on GPU, ``time.perf_counter`` on
CPU), tokens/s, speedup over bf16, peak memory (CUDA), and the first/last losses with the
first loss's relative difference from bf16 (same weights, same batch: a numerics check).

GPU (one H100), the issue-6 configuration:

    python benchmarks/bench_train.py --preset llama3-8b-4l --compile

CPU (CI smoke test and the published CPU table, numbers/bench_train.json):

    python benchmarks/bench_train.py --preset tiny --device cpu --no-compile

Writes ``runs/benchmarks/<date>-<device>-train-PRESET-{compiled,eager}.json`` (+ ``.md``)
with ``device, torch, torchao, date, command, rows`` and ``skipped``: the recipes this GPU
cannot run (mxfp8 before sm100), each with the reason.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
from pathlib import Path

import common
import torch

sys.path.insert(0, str(common.REPO / "recipes"))
from model import PRESETS, ModelArgs, Transformer  # noqa: E402

# Tokens per step that fit one device with bf16 params + AdamW state: (batch, seq_len).
SHAPE_DEFAULTS = {"tiny": (4, 64), "small": (4, 128), "1b": (4, 2048), "llama3-8b-4l": (1, 8192)}

# ----------------------------------------------------------------------------
# variants


def keep_head(mod, fqn: str) -> bool:
    """The recipes' filter: every block Linear with float8-able dims; the lm head stays hp."""
    return fqn != "output" and mod.in_features % 16 == 0 and mod.out_features % 16 == 0


def build(variant: str, recipe: str | None, margs: ModelArgs, device, ao_float8):
    """(model, precompute or None) for one variant; raises ValueError if it cannot be built."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(margs)
    model = model.to(torch.bfloat16)
    if variant == "float8kit":
        import float8kit

        config = float8kit.Float8LinearConfig.from_recipe_name(recipe)
        float8kit.convert_to_float8_training(
            model,
            config=config,
            # keep_head, plus the recipe's own dims rule (blockwise: multiples of 128)
            module_filter_fn=lambda mod, fqn: (
                keep_head(mod, fqn) and float8kit.default_module_filter(mod, fqn, config)
            ),
        )
        return model, float8kit.precompute_scales
    if variant == "torchao":
        if ao_float8 is None:
            raise ValueError("torchao.float8 not importable")
        ao_float8.convert_to_float8_training(
            model,
            config=common.torchao_recipe_config(ao_float8, recipe),
            module_filter_fn=keep_head,
        )
    return model, None


# ----------------------------------------------------------------------------
# main


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--preset",
        default=None,
        help="recipes/model.py preset (" + ", ".join(PRESETS) + "); default "
        "llama3-8b-4l on CUDA, tiny on CPU",
    )
    p.add_argument(
        "--recipes",
        default="tensorwise,rowwise",
        help="comma list of float8 recipes to run for both libraries ('all': every "
        "float8kit recipe this checkout has)",
    )
    p.add_argument(
        "--libs", default="bf16,float8kit,torchao", help="comma list of bf16, float8kit, torchao"
    )
    p.add_argument("--batch", type=int, default=None, help="sequences per step (preset default)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (preset default)")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the model (default: on for CUDA, off for CPU)",
    )
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 5 CUDA, 2 CPU)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20 CUDA, 5 CPU)")
    p.add_argument("--n-batches", type=int, default=4, help="pre-made batches cycled through")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--threads", type=int, default=None, help=common.THREADS_HELP)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default runs/benchmarks/<date>-<device>-train-PRESET-"
        "{compiled,eager}.json)",
    )
    args = p.parse_args()

    common.set_threads(args.threads)
    device = common.pick_device(args.device)
    on_cuda = device.type == "cuda"
    preset = args.preset or ("llama3-8b-4l" if on_cuda else "tiny")
    margs = ModelArgs.from_name(preset)
    batch, seq = SHAPE_DEFAULTS.get(preset, (4, 128))
    batch, seq = args.batch or batch, args.seq or seq
    if seq > margs.max_seq_len:
        margs = ModelArgs.from_name(preset, max_seq_len=seq)
    compiled = args.compile if args.compile is not None else on_cuda
    warmup = args.warmup if args.warmup is not None else (5 if on_cuda else 2)
    steps = args.steps if args.steps is not None else (20 if on_cuda else 5)
    recipes = (
        common.float8kit_recipes()
        if args.recipes == "all"
        else [r.strip() for r in args.recipes.split(",")]
    )
    # mxfp8 before sm100 (H100, H200): skipped and recorded (float8kit would raise)
    recipes, skipped = common.runnable_recipes(device, recipes)
    for why in skipped:
        print(f"skipped: {why}", flush=True)
    libs = [x.strip() for x in args.libs.split(",")]
    ao_float8, ao_note = common.import_torchao_float8()
    info = common.run_info(device)
    print(f"# {info['device']} | torch {info['torch']} | torchao {info['torchao']}", flush=True)

    g = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, margs.vocab_size, (batch, seq + 1), generator=g).to(device)
        for _ in range(args.n_batches)
    ]
    variants = [("bf16", None)] if "bf16" in libs else []
    variants += [(lib, r) for r in recipes for lib in ("float8kit", "torchao") if lib in libs]

    rows = []
    out = args.out or common.default_out(
        device, "train", preset, "compiled" if compiled else "eager"
    )

    def report(complete: bool):
        """Speedups over bf16, checks, and the JSON + .md of the rows so far: before every
        variant too, so a run stopped by a time limit keeps the variants it finished."""
        base = next((r for r in rows if r["library"] == "bf16" and "step_ms" in r), None)
        bad = []
        for r in rows:
            if "loss_last" in r and not math.isfinite(r["loss_last"]):
                bad.append(f"{r['variant']}: non-finite loss {r['loss_last']}")
            if base and "step_ms" in r:
                r["speedup_vs_bf16"] = round(base["step_ms"] / r["step_ms"], 3)
                r["loss_first_rel_diff_vs_bf16"] = round(
                    abs(r["loss_first"] - base["loss_first"]) / abs(base["loss_first"]), 5
                )
        with torch.device("meta"):
            n_params = sum(p.numel() for p in Transformer(margs).parameters())
        payload = {
            **info,
            "kind": "train",
            "preset": preset,
            "n_params": n_params,
            "batch": batch,
            "seq": seq,
            "tokens_per_step": batch * seq,
            "compiled": compiled,
            "warmup": warmup,
            "steps": steps,
            "params_dtype": "bfloat16",
            "optimizer": "AdamW",
            "timing": "CUDA events" if on_cuda else "perf_counter",
            "rows": rows,
            "skipped": skipped,
            "failures": bad,
            "complete": complete,
        }
        columns = [
            ("variant", "variant"),
            ("compiled", "compiled"),
            ("float8_linears", "fp8 linears"),
            ("step_ms", "step ms"),
            ("tokens_per_s", "tokens/s"),
            ("speedup_vs_bf16", "speedup vs bf16"),
            ("peak_mem_gib", "peak GiB"),
            ("loss_first", "loss step 1"),
            ("loss_first_rel_diff_vs_bf16", "rel diff vs bf16"),
            ("loss_last", "last loss"),
            ("error", "error"),
        ]
        table = common.markdown_table(rows, columns, ndigits=4)
        table += (
            f"\n\nPreset {preset}, {batch}x{seq} tokens per step, bf16 params + AdamW, "
            f"median of {steps} steps after {warmup} warm-up."
        )
        json_path, md_path = common.write_results(
            out, payload, table, "bench_train: training-step tokens/s, recipes model"
        )
        return table, json_path, md_path, bad

    for lib, recipe in variants:
        if rows:
            report(complete=False)
        row = {
            "variant": lib if recipe is None else f"{lib}:{recipe}",
            "library": lib,
            "recipe": recipe,
            "compiled": compiled,
            "preset": preset,
            "batch": batch,
            "seq": seq,
        }
        try:
            model, precompute = build(lib, recipe, margs, device, ao_float8)
        except Exception as e:  # noqa: BLE001  (a library refusing a recipe is a result)
            row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
            print(row, flush=True)
            continue
        n_linear_fp8 = sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
        step_model = torch.compile(model) if compiled else model
        optim = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=on_cuda)
        losses = []
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(device)

        def step(
            i, step_model=step_model, optim=optim, precompute=precompute, model=model, losses=losses
        ):
            idx = batches[i % len(batches)]
            loss = step_model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            if precompute is not None:
                precompute(model)
            losses.append(loss.detach())

        try:
            times = common.time_ms(step, device, warmup=warmup, iters=steps)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            rows.append(row)
            print(row, flush=True)
            del model, step_model, optim
            continue
        ms = common.median(times)
        row.update(
            float8_linears=n_linear_fp8,
            step_ms=round(ms, 3),
            tokens_per_s=round(batch * seq / (ms / 1e3), 1),
            loss_first=round(losses[0].item(), 5),
            loss_last=round(losses[-1].item(), 5),
            peak_mem_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            if on_cuda
            else None,
        )
        rows.append(row)
        print(" ".join(f"{k}={common.fmt(v)}" for k, v in row.items()), flush=True)
        del model, step_model, optim, losses
        if compiled:
            torch._dynamo.reset()  # a fresh compile per variant, no recompile limit to hit
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()

    table, json_path, md_path, bad = report(complete=True)
    print("\n" + table)
    print(f"\nwrote {json_path} and {md_path}")
    if bad:
        print("FAILED: " + "; ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
