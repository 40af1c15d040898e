"""The one-pass tensorwise cast's CUDA kernel (float8kit/triton_cast.py) against the kernel
inductor writes for the same cast, on a GPU: milliseconds and the bandwidth each reaches
(bytes: 2 per bf16 element read, 1 per float8 layout written), per tile shape.

For each operand shape of the seed layer (4096x8192x16384: input 4096x8192, weight
16384x8192, grad_output 4096x16384), bf16 values, a static scale:

- ``inductor``: ``torch.compile`` of the cast to both layouts (one Triton kernel on CUDA);
- ``float8kit <tile>``: ``triton_cast.cast_tensorwise`` with that tile, both layouts, and
  both layouts + the amax (a DELAYED cast).

Times are ``triton.testing.do_bench`` medians; ``best_tile`` is the tile with the least
total time over the three shapes (both layouts), the one ``triton_cast.TILE`` should be.

    python benchmarks/bench_cast.py --out benchmarks/results/<dir>/cast.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import common
import torch

SHAPES = [(4096, 8192), (16384, 8192), (4096, 16384)]
TILES = [(64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8), (32, 128, 4), (128, 32, 4)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cast: needs a CUDA GPU (the kernel is Triton's)")
    import triton.testing

    from float8kit import cast, scaling, triton_cast

    fp8 = torch.float8_e4m3fn
    limit = scaling.fp8_max(fp8)
    scale = torch.tensor(4.0, device="cuda")

    def inductor_cast(x, s):
        data = cast.to_fp8_saturated(x, s, fp8)
        return data, data.t().contiguous()

    compiled = torch.compile(inductor_cast)
    rows = []
    for m, n in SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        nbytes = 4 * m * n
        want = compiled(x, scale)
        ms = triton.testing.do_bench(functools.partial(compiled, x, scale))
        rows.append({"shape": [m, n], "variant": "inductor", "ms": ms, "gbps": nbytes / ms / 1e6})
        for tile in TILES:
            for amax in (False, True):
                got = triton_cast.cast_tensorwise(
                    x, scale, fp8, True, True, True, amax, limit, tile
                )
                same = all(
                    torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for a, b in zip(got[:2], want, strict=True)
                )
                call = functools.partial(
                    triton_cast.cast_tensorwise, x, scale, fp8, True, True, True, amax, limit, tile
                )
                ms = triton.testing.do_bench(call)
                rows.append(
                    {
                        "shape": [m, n],
                        "variant": "float8kit+amax" if amax else "float8kit",
                        "tile": list(tile),
                        "ms": ms,
                        "gbps": nbytes / ms / 1e6,
                        "bitwise_inductor": same,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    totals = {
        tuple(t): sum(
            r["ms"] for r in rows if r.get("tile") == list(t) and r["variant"] == "float8kit"
        )
        for t in TILES
    }
    best = min(totals, key=totals.get)
    inductor_total = sum(r["ms"] for r in rows if r["variant"] == "inductor")
    payload = {
        **common.run_info(torch.device("cuda")),
        "kind": "cast",
        "rows": rows,
        "best_tile": list(best),
        "best_total_ms": totals[best],
        "inductor_total_ms": inductor_total,
        "current_tile": list(triton_cast.TILE),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"best tile {best}: {totals[best]:.3f} ms vs inductor {inductor_total:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
