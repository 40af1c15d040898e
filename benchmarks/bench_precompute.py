"""Host cost of ``precompute_scales`` per step: delayed scaling's amax-history update.

After every ``optimizer.step()`` a delayed-scaling model calls ``precompute_scales(model)``:
it folds each layer's amax records into the histories and writes the next scales. This
measures, for models of 1 to N delayed Float8Linear layers, the host time of that call
(median, ``time.perf_counter`` around the call, no synchronize inside it): per call and per
layer, and the aten ops it launches. On CUDA it also times the call with the GPU still busy
(a queue of large matmuls ahead of it): a call that returns in about its idle time does
not wait for the GPU; one that takes about the queued GPU time does (the host cannot run
ahead of the GPU across it, which a training loop that never synchronizes relies on).

    python benchmarks/bench_precompute.py --device cuda --layers 1,8,32
    python benchmarks/bench_precompute.py --device cpu --layers 1,8 --out /tmp/precompute.json

Writes ``runs/benchmarks/<date>-<device>-precompute.json`` (``--out`` to change) and its
``.md`` table. The training step itself (forward + backward, which fills the records) runs
between the timed calls and is not timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import common
import torch
from torch import nn


def build(layers: int, dim: int, recipe: str, device) -> nn.Module:
    import float8kit

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    model = model.to(device=device, dtype=torch.bfloat16)
    return float8kit.convert_to_float8_training(
        model, config=common.float8kit_config(recipe), module_filter_fn=lambda m, fqn: True
    )


def fill_records(model: nn.Module, x: torch.Tensor) -> None:
    """One forward + backward: every delayed layer records its amaxes."""
    model(x).float().square().mean().backward()
    for p in model.parameters():
        p.grad = None


def host_us(model, x, calls: int, device, busy: torch.Tensor | None = None) -> list[float]:
    """Host time of ``precompute_scales(model)``, per call, in microseconds (records filled
    before each call; with ``busy``, a queue of matmuls is launched right before it)."""
    from float8kit import precompute_scales

    times = []
    for _ in range(calls):
        fill_records(model, x)
        common.sync(device)
        if busy is not None:
            for _ in range(8):
                busy @ busy
        t0 = time.perf_counter()
        precompute_scales(model)
        times.append((time.perf_counter() - t0) * 1e6)
        common.sync(device)
    return times


def busy_gpu_ms(busy: torch.Tensor) -> float:
    """GPU time of the queue ``host_us`` launches ahead of the call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(8):
        busy @ busy
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def aten_ops(model, x) -> int:
    from float8kit import precompute_scales

    fill_records(model, x)
    with common.OpCounter() as counter:
        precompute_scales(model)
    return sum(counter.counts.values())


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", default="1,8,32", help="comma list of layer counts")
    p.add_argument("--dim", type=int, default=256, help="each layer's in and out features")
    p.add_argument("--tokens", type=int, default=64, help="rows of the input")
    p.add_argument("--recipe", default="delayed", help="a recipe with DELAYED scaling")
    p.add_argument("--calls", type=int, default=30, help="timed calls per layer count")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--threads", type=int, default=None, help=common.THREADS_HELP)
    p.add_argument("--out", type=Path, default=None, help="JSON path (.md beside it)")
    args = p.parse_args()
    common.set_threads(args.threads)
    device = common.pick_device(args.device)
    on_cuda = device.type == "cuda"
    info = common.run_info(device)
    print(f"# {info['device']} | torch {info['torch']}", flush=True)

    busy = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) if on_cuda else None
    rows = []
    for layers in [int(n) for n in args.layers.split(",")]:
        model = build(layers, args.dim, args.recipe, device)
        x = torch.randn(args.tokens, args.dim, device=device, dtype=torch.bfloat16)
        host_us(model, x, 3, device)  # warm-up: DELAYED scales marked set, caches warm
        idle = round(statistics.median(host_us(model, x, args.calls, device)), 1)
        row = dict(
            layers=layers,
            recipe=args.recipe,
            host_us=idle,
            host_us_per_layer=round(idle / layers, 1),
            aten_ops=aten_ops(model, x),
        )
        if on_cuda:
            row["busy_gpu_ms"] = round(busy_gpu_ms(busy), 3)
            busy_host = statistics.median(host_us(model, x, args.calls, device, busy))
            row["host_us_gpu_busy"] = round(busy_host, 1)
            # waits: the call took more than half the queued GPU time beyond its idle time
            row["waits_for_gpu"] = busy_host - idle > 500 * row["busy_gpu_ms"]
        rows.append(row)
        print(" ".join(f"{k}={common.fmt(v)}" for k, v in row.items()), flush=True)

    payload = {**info, "kind": "precompute", "dim": args.dim, "tokens": args.tokens, "rows": rows}
    columns = [
        ("layers", "layers"),
        ("recipe", "recipe"),
        ("host_us", "host us per call"),
        ("host_us_per_layer", "host us per layer"),
        ("aten_ops", "aten ops"),
        ("busy_gpu_ms", "queued GPU ms"),
        ("host_us_gpu_busy", "host us, GPU busy"),
        ("waits_for_gpu", "waits for the GPU"),
    ]
    table = common.markdown_table(rows, columns)
    out = args.out or common.default_out(device, "precompute")
    json_path, md_path = common.write_results(
        out, payload, table, "bench_precompute: precompute_scales host time per step"
    )
    print("\n" + table + f"\n\nwrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
