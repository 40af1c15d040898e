"""Per-call host overhead of a small float8 Linear: float8kit vs torchao.float8, eager or
compiled (``--compile``).

A layer so small that the gemms cost next to nothing (default 16x64x64), forward + backward,
eager. float8kit, torchao and a bf16 ``nn.Linear`` (same weights) are timed in blocks of
--calls calls, the three blocks interleaved in one process for --rounds rounds (the order
rotates each round so neither library always runs first); the result is the median per-call
time of each and the median of the per-round ratios float8kit / torchao (< 1: float8kit
has less overhead). This is Python + dispatcher overhead, what dominates small layers and
every layer of a small model; on a GPU the wall time of a small layer is the same kind of
number (launch-bound), so --device cuda measures it with a synchronize per block. Each row
also counts the aten ops one call dispatches (each one a kernel launch on a GPU, eager).

The floor (eager tensorwise): a fourth block times the same float8 math written by hand, one
autograd Function and nothing else (``ByHandLinear``: the same casts, the same three
``torch._scaled_mm`` calls, the same tensors kept for backward), checked bit for bit against
float8kit's layer before timing. ``ratio_float8kit_over_byhand`` near 1 says float8kit's
eager cost is its aten ops, with no library overhead left to cut above them.

``--compile``: each library's layer runs under ``torch.compile`` (a step function of its own,
so that each has its own dynamo cache), forward + backward; each row then counts the dynamo
guards the compiled forward checks before it runs (the leaf guards of every cache entry of
its frame): host work on every call, which a per-step sync turns into GPU idle time.

    python benchmarks/bench_overhead.py --threads 1                   # CPU, tensorwise
    python benchmarks/bench_overhead.py --recipes tensorwise,rowwise --profile
    python benchmarks/bench_overhead.py --device cuda --shape 16x4096x4096
    python benchmarks/bench_overhead.py --threads 1 --compile          # compiled, with guards

--profile adds torch.profiler's top ops (self CPU time per call) for each library, which is
what benchmarks/NOTES.md reads. Writes ``runs/benchmarks/<date>-<device>-overhead.json``
(+ ``.md``) with ``device, torch, torchao, date, command, rows``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import types
from pathlib import Path

import common
import torch
from torch import nn

LIBS = ("float8kit", "torchao", "bf16")
# eager tensorwise only: the same float8 math written by hand (``ByHandLinear``)
BYHAND = "byhand"


# ----------------------------------------------------------------------------
# layers and one call


def make_layers(k: int, n: int, recipe: str, device, ao_float8) -> dict[str, nn.Module]:
    import float8kit

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(k, n, bias=False)).to(device=device, dtype=torch.bfloat16)
    return {
        "float8kit": float8kit.convert_to_float8_training(
            copy.deepcopy(base), config=float8kit.Float8LinearConfig.from_recipe_name(recipe)
        ),
        "torchao": ao_float8.convert_to_float8_training(
            copy.deepcopy(base), config=common.torchao_recipe_config(ao_float8, recipe)
        ),
        "bf16": base,
    }


class _ByHandMatmul(torch.autograd.Function):
    """Dynamic tensorwise float8 ``x @ w.T`` in one Function, nothing else: the three casts
    (amax, fp8_max / amax in fp64, saturate), the three ``torch._scaled_mm`` calls; e4m3
    input and weight, e5m2 grad_output; kept for backward: the cast input, the hp weight and
    its scale (the weight cast again there, as float8kit keeps no float8 weight copy). The
    ops float8kit's eager tensorwise layer dispatches, without a library around them."""

    @staticmethod
    def forward(ctx, x, w):
        x8, x_scale = _cast_by_hand(x, torch.float8_e4m3fn)
        w8, w_scale = _cast_by_hand(w, torch.float8_e4m3fn)
        inv_x, inv_w = x_scale.reciprocal(), w_scale.reciprocal()
        ctx.save_for_backward(x8, inv_x, w, w_scale)
        return torch._scaled_mm(x8, w8.t(), inv_x, inv_w, out_dtype=x.dtype)

    @staticmethod
    def backward(ctx, go):
        x8, inv_x, w, w_scale = ctx.saved_tensors
        w8 = _saturate(w, w_scale, torch.float8_e4m3fn)  # the forward's cast again
        inv_w = w_scale.reciprocal()
        g8, g_scale = _cast_by_hand(go.contiguous(), torch.float8_e5m2)
        inv_g = g_scale.reciprocal()
        # the gemms take their second operand column-major
        grad_x = torch._scaled_mm(g8, w8.t().contiguous().t(), inv_g, inv_w, out_dtype=go.dtype)
        g8_t = g8.t().contiguous()
        grad_w = torch._scaled_mm(g8_t, x8.t().contiguous().t(), inv_g, inv_x, out_dtype=go.dtype)
        return grad_x, grad_w


def _cast_by_hand(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    limit = torch.finfo(dtype).max
    amax = torch.amax(torch.abs(t)).to(torch.float32)
    floor = float8kit_amax_floor(dtype)
    scale = (limit / torch.clamp(amax, min=floor).to(torch.float64)).to(torch.float32)
    return _saturate(t, scale, dtype), scale


def _saturate(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return torch.clamp(t.to(torch.float32) * scale, min=-limit, max=limit).to(dtype)


def float8kit_amax_floor(dtype: torch.dtype) -> float:
    """The amax floor of float8kit's scale rule (a constant), so both give the same bits."""
    from float8kit import scaling

    return scaling.amax_floor(dtype)


class ByHandLinear(nn.Module):
    """A bias-free Linear whose matmul is ``_ByHandMatmul`` (the bf16 layer's weight)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ByHandMatmul.apply(x, self.weight)


def byhand_is_bitwise(ours: nn.Module, byhand: nn.Module, x, go) -> bool:
    """Whether the by-hand layer gives float8kit's output and gradients bit for bit (the
    same math, so its time is the floor of that math's ops)."""
    got = []
    for mod in (ours, byhand):
        xi = x.detach().clone().requires_grad_()
        y = mod(xi)
        y.backward(go)
        got.append((y, xi.grad, mod[0].weight.grad))
        mod[0].weight.grad = None
    return all(torch.equal(a, b) for a, b in zip(*got, strict=True))


class Step:
    """One library's fwd+bwd call on its layer: eager, or compiled from a step function of
    its own (a code object per library: dynamo keeps its cache entries per code object)."""

    def __init__(self, lib: str, mod: nn.Module, compiled: bool):
        def step(x):
            return mod(x)

        code = step.__code__.replace(co_name=f"step_{lib}")
        self.fn = types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__)
        self.mod, self.run = mod, torch.compile(self.fn) if compiled else self.fn

    def __call__(self, x: torch.Tensor, go: torch.Tensor) -> None:
        # a new input tensor per call (same storage), as each step of a training loop has: a
        # library that keys work on the input tensor (float8kit keeps one cast per tensor
        # for the layers that read it) must not carry it from one call to the next
        self.run(x.detach().requires_grad_()).backward(go)
        self.mod[0].weight.grad = None

    def guards(self) -> int:
        """The leaf guards of every dynamo cache entry of the compiled step's frame."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        def leaves(manager) -> int:
            return len(manager.get_leaf_guards()) + sum(
                leaves(child) for child in manager.get_child_managers()
            )

        entries = _debug_get_cache_entry_list(self.fn.__code__)
        return sum(leaves(e.guard_manager.root) for e in entries)


def block_us(step: Step, x, go, calls: int, device) -> float:
    """Mean wall time per call over one block of ``calls`` calls, in microseconds."""
    common.sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        step(x, go)
    common.sync(device)
    return (time.perf_counter() - t0) / calls * 1e6


def profile_top(step: Step, x, go, calls: int, top: int) -> list[dict]:
    """torch.profiler's ops by self CPU time, per call."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step(x, go)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            step(x, go)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [
        {
            "op": e.key,
            "calls_per_step": round(e.count / calls, 2),
            "self_cpu_us_per_step": round(e.self_cpu_time_total / calls, 2),
            "share": round(e.self_cpu_time_total / total, 3),
        }
        for e in events[:top]
    ] + [
        {
            "op": "TOTAL (all ops, self)",
            "calls_per_step": round(sum(e.count for e in events) / calls, 1),
            "self_cpu_us_per_step": round(total / calls, 2),
            "share": 1.0,
        }
    ]


# ----------------------------------------------------------------------------
# main


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="16x64x64", help="MxKxN of the layer (tokens x in x out)")
    p.add_argument("--recipes", default="tensorwise", help="comma list of recipes")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds (median over them)")
    p.add_argument("--calls", type=int, default=20, help="calls per timed block")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls per layer first")
    p.add_argument(
        "--compile",
        action="store_true",
        help="run every layer under torch.compile and count its dynamo guards",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also record torch.profiler top ops per library (into the JSON)",
    )
    p.add_argument("--top", type=int, default=15, help="ops per library in --profile")
    p.add_argument("--threads", type=int, default=None, help=common.THREADS_HELP)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default runs/benchmarks/<date>-<device>-overhead.json)",
    )
    args = p.parse_args()

    common.set_threads(args.threads)
    device = common.pick_device(args.device)
    M, K, N = (int(v) for v in args.shape.split("x"))
    ao_float8, ao_note = common.import_torchao_float8()
    if ao_float8 is None:
        raise SystemExit(f"bench_overhead needs torchao.float8, which is missing: {ao_note}")
    info = common.run_info(device)
    print(f"# {info['device']} | torch {info['torch']} | torchao {info['torchao']}", flush=True)

    torch.manual_seed(0)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    rows, profiles = [], {}
    for recipe in [r.strip() for r in args.recipes.split(",")]:
        layers = make_layers(K, N, recipe, device, ao_float8)
        libs = LIBS
        if recipe == "tensorwise" and not args.compile:
            libs += (BYHAND,)
            layers[BYHAND] = nn.Sequential(ByHandLinear(copy.deepcopy(layers["bf16"][0])))
            if not byhand_is_bitwise(layers["float8kit"], layers[BYHAND], x, go):
                raise SystemExit(
                    "bench_overhead: the by-hand tensorwise layer does not give float8kit's "
                    "bits, so it is no floor for float8kit's ops: fix ByHandLinear"
                )
        steps = {lib: Step(lib, mod, args.compile) for lib, mod in layers.items()}
        from float8kit import precompute_scales

        for lib, mod in layers.items():
            for _ in range(args.warmup):
                steps[lib](x, go)
                if lib == "float8kit":  # steady state: DELAYED scales set, as in training
                    precompute_scales(mod)
        per_call: dict[str, list[float]] = {lib: [] for lib in libs}
        ratios, floor_ratios = [], []
        for r in range(args.rounds):
            order = libs[r % len(libs) :] + libs[: r % len(libs)]
            got = {lib: block_us(steps[lib], x, go, args.calls, device) for lib in order}
            for lib in libs:
                per_call[lib].append(got[lib])
            ratios.append(got["float8kit"] / got["torchao"])
            if BYHAND in got:
                floor_ratios.append(got["float8kit"] / got[BYHAND])
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        row = {
            "recipe": recipe,
            "M": M,
            "K": K,
            "N": N,
            "mode": "fwd_bwd",
            "compiled": args.compile,
            "float8kit_us": round(common.median(per_call["float8kit"]), 2),
            "torchao_us": round(common.median(per_call["torchao"]), 2),
            "bf16_us": round(common.median(per_call["bf16"]), 2),
            "ratio_float8kit_over_torchao": round(common.median(ratios), 4),
            "ratio_q1": round(q[0], 4),
            "ratio_q3": round(q[2], 4),
            **{
                f"{lib}_aten_ops": common.count_aten_ops(layers[lib], M, K, N, True) for lib in LIBS
            },
            **({f"{lib}_guards": steps[lib].guards() for lib in LIBS} if args.compile else {}),
            **(
                {
                    "byhand_us": round(common.median(per_call[BYHAND]), 2),
                    "ratio_float8kit_over_byhand": round(common.median(floor_ratios), 4),
                    "byhand_aten_ops": common.count_aten_ops(layers[BYHAND], M, K, N, True),
                    "byhand_bitwise": True,
                }
                if floor_ratios
                else {}
            ),
            "rounds": args.rounds,
            "calls_per_round": args.calls,
        }
        rows.append(row)
        print(" ".join(f"{k}={common.fmt(v)}" for k, v in row.items()), flush=True)
        if args.profile:
            profiles[recipe] = {
                lib: profile_top(steps[lib], x, go, 50, args.top)
                for lib in ("float8kit", "torchao")
            }

    payload = {**info, "kind": "overhead", "shape": [M, K, N], "compiled": args.compile}
    payload["rows"] = rows
    if profiles:
        payload["profile"] = profiles
    columns = [
        ("recipe", "recipe"),
        ("M", "M"),
        ("K", "K"),
        ("N", "N"),
        ("float8kit_us", "float8kit us/call"),
        ("torchao_us", "torchao us/call"),
        ("bf16_us", "bf16 us/call"),
        ("ratio_float8kit_over_torchao", "float8kit/torchao (median of rounds)"),
        ("ratio_q1", "ratio q1"),
        ("ratio_q3", "ratio q3"),
        ("float8kit_aten_ops", "fk aten ops"),
        ("torchao_aten_ops", "ao aten ops"),
        ("bf16_aten_ops", "bf16 aten ops"),
    ]
    if args.compile:
        columns += [(f"{lib}_guards", f"{lib} dynamo guards") for lib in LIBS]
    table = common.markdown_table(rows, columns)
    for recipe, libs in profiles.items():
        for lib, ops in libs.items():
            table += f"\n\nTop ops by self CPU time, {lib} {recipe} (per fwd+bwd call):\n\n"
            table += common.markdown_table(
                ops,
                [
                    ("op", "op"),
                    ("calls_per_step", "calls"),
                    ("self_cpu_us_per_step", "self us"),
                    ("share", "share"),
                ],
                ndigits=2,
            )
    out = args.out or common.default_out(device, "overhead")
    json_path, md_path = common.write_results(
        out,
        payload,
        table,
        f"bench_overhead: {'compiled' if args.compile else 'eager'} per-call time, float8kit vs "
        "torchao.float8",
    )
    print("\n" + table)
    print(f"\nwrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
