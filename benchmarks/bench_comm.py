"""Bytes and collectives per FSDP2 training step: bf16 vs float8kit vs torchao.float8.

Two CPU processes (gloo) train the recipes model (``recipes/model.py``) under FSDP2
(``fully_shard`` on each block, then the root; bf16 params, fp32 gradient reduction). On
rank 0 the last of --steps steps is counted: every collective FSDP2 and the float8
libraries issue, with its bytes. Counting wraps the ``torch.distributed`` functions FSDP2
calls in torch 2.13 (``all_gather_single`` for parameters, ``reduce_scatter_single`` for
gradients, ``all_reduce`` for HSDP; see torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py) plus the older ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` /
``broadcast``, and the functional collectives' op packets (``torch.ops._c10d_functional.*``,
which DTensor's reductions call directly, e.g. torchao's one all-reduce for precomputed
weight scales).
Bytes: all-gather = the gathered output each rank receives; reduce-scatter = the unsharded
gradient input each rank sends; all-reduce = the tensor.

Variants: bf16; float8kit and torchao tensorwise with bf16 all-gather; both with float8
all-gather (``enable_fsdp_float8_all_gather=True``, then the library's scale precompute after
the optimizer step); and float8kit's delayed recipe, with and without float8 all-gather
(precompute_scales folds every layer's amax history with one all-reduce). A variant a
library cannot run is a row that says why: "not available" when torchao cannot be imported,
and an error (e.g. a float8 dtype gloo refuses) as its text.

    python benchmarks/bench_comm.py                         # preset tiny, 3 steps
    python benchmarks/bench_comm.py --preset small --steps 3

Writes ``runs/benchmarks/<date>-cpu-comm-PRESET-wN.json`` (+ ``.md``) with ``device, torch,
torchao, date, command, rows``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import socket
import sys
import tempfile
import traceback
from pathlib import Path

import common
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(common.REPO / "recipes"))
from model import ModelArgs, Transformer  # noqa: E402

# <library>[_delayed][_fp8_allgather]: float8 recipe tensorwise (or delayed), with float8
# all-gather of the weights or without.
VARIANTS = [
    "bf16",
    "float8kit",
    "float8kit_fp8_allgather",
    "float8kit_delayed",
    "float8kit_delayed_fp8_allgather",
    "torchao",
    "torchao_fp8_allgather",
]

# ----------------------------------------------------------------------------
# counting collectives


class CommCounter:
    """Counts collectives and their bytes while ``active``; wraps ``torch.distributed``."""

    # name -> which tensor's bytes to count: the received all-gather output, the sent
    # reduce-scatter input, the all-reduced/broadcast tensor.
    WRAPPED = {
        "all_gather_single": ("output_tensor", 0),
        "all_gather_into_tensor": ("output_tensor", 0),
        "reduce_scatter_single": ("input", 1),
        "reduce_scatter_tensor": ("input", 1),
        "all_reduce": ("tensor", 0),
        "broadcast": ("tensor", 0),
    }
    FUNCTIONAL = (
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
        "broadcast",
    )
    KIND = {
        "all_gather": "all_gather",
        "reduce_scatter": "reduce_scatter",
        "all_reduce": "all_reduce",
        "broadcast": "broadcast",
    }

    def __init__(self):
        self.active = False
        self.reset()
        self._orig = {}
        self._orig_functional = {}

    def reset(self):
        self.calls = collections.Counter()
        self.bytes = collections.Counter()
        self.dtypes = collections.defaultdict(set)

    def record(self, name: str, t: torch.Tensor) -> None:
        if not self.active:
            return
        kind = next(v for k, v in self.KIND.items() if k in name)
        self.calls[kind] += 1
        self.bytes[kind] += t.numel() * t.element_size()
        self.dtypes[kind].add(str(t.dtype).replace("torch.", ""))

    def install(self) -> None:
        for name, (kw, pos) in self.WRAPPED.items():
            orig = getattr(dist, name, None)
            if orig is None:
                continue
            self._orig[name] = orig

            def wrapper(*args, _orig=orig, _name=name, _kw=kw, _pos=pos, **kwargs):
                t = kwargs.get(_kw, args[_pos] if len(args) > _pos else None)
                if isinstance(t, torch.Tensor):
                    self.record(_name, t)
                return _orig(*args, **kwargs)

            setattr(dist, name, wrapper)

        # Functional collectives (DTensor redistribution, funcol) call these op packets
        # directly, bypassing the functions above: wrap the packets on their namespace.
        ns = torch.ops._c10d_functional
        for name in self.FUNCTIONAL:
            orig = getattr(ns, name, None)
            if orig is None:
                continue
            self._orig_functional[name] = orig

            setattr(ns, name, _CountingPacket(orig, name, self))

    def uninstall(self) -> None:
        for name, orig in self._orig.items():
            setattr(dist, name, orig)
        for name, orig in self._orig_functional.items():
            setattr(torch.ops._c10d_functional, name, orig)


class _CountingPacket:
    """Stands in for an op packet: calls are counted, anything else (``.default``, which op
    tables use as a key) is the real packet's."""

    def __init__(self, packet, name: str, counter: CommCounter):
        self._packet, self._name, self._counter = packet, name, counter

    def __call__(self, *args, **kwargs):
        out = self._packet(*args, **kwargs)
        ts = out if "all_gather" in self._name else args[0]  # gathered output; else input
        for t in ts if isinstance(ts, (list, tuple)) else [ts]:
            self._counter.record("functional_" + self._name, t)
        return out

    def __getattr__(self, attr):
        return getattr(self._packet, attr)


# ----------------------------------------------------------------------------
# one rank


def build(variant: str, args: ModelArgs, seed: int):
    """The model for ``variant`` and the per-step scale precompute to call (or None), or a
    string saying why the variant is not available (torchao missing)."""
    torch.manual_seed(seed)
    model = Transformer(args)
    keep_head = lambda mod, fqn: fqn != "output" and mod.in_features % 16 == 0  # noqa: E731
    fp8_ag = variant.endswith("_fp8_allgather")
    if variant.startswith("float8kit"):
        import float8kit

        recipe = "delayed" if "_delayed" in variant else "tensorwise"
        config = float8kit.Float8LinearConfig.from_recipe_name(recipe)
        if fp8_ag:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        float8kit.convert_to_float8_training(model, config=config, module_filter_fn=keep_head)
        return model, float8kit.precompute_scales
    if variant.startswith("torchao"):
        ao_float8, note = common.import_torchao_float8()
        if ao_float8 is None:
            return f"not available: {note}"
        config = ao_float8.Float8LinearConfig.from_recipe_name("tensorwise")
        if fp8_ag:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        ao_float8.convert_to_float8_training(model, config=config, module_filter_fn=keep_head)
        pre = ao_float8.precompute_float8_dynamic_scale_for_fsdp if fp8_ag else None
        return model, pre
    return model, None


def run_variant(variant: str, margs: ModelArgs, opts: dict, counter: CommCounter) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    built = build(variant, margs, seed=0)
    if isinstance(built, str):
        return {"variant": variant, "status": built}
    model, precompute = built
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for step in range(opts["steps"]):
        counter.reset()
        counter.active = step == opts["steps"] - 1  # count the last, steady-state step
        idx = torch.randint(0, margs.vocab_size, (opts["batch"], opts["seq"] + 1), generator=g)
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if precompute is not None:
            precompute(model)
        counter.active = False
        losses.append(loss.item())
    row = {"variant": variant, "status": "ok", "final_loss": round(losses[-1], 4)}
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "broadcast"):
        row[f"{kind}_bytes"] = counter.bytes[kind]
        row[f"{kind}_calls"] = counter.calls[kind]
        row[f"{kind}_dtypes"] = ",".join(sorted(counter.dtypes[kind]))
    row["collectives"] = sum(counter.calls.values())
    return row


def worker(rank: int, world: int, port: int, margs: ModelArgs, opts: dict, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if any(v.startswith("torchao") for v in opts["variants"]):
        common.import_torchao_float8()  # import it quietly, before any variant needs it
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=opts["timeout_s"])
    )
    counter = CommCounter()
    counter.install()
    rows = []
    try:
        for variant in opts["variants"]:
            try:
                rows.append(run_variant(variant, margs, opts, counter))
            except Exception as e:  # noqa: BLE001  (a library's failure is a result)
                counter.active = False
                msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400]}"
                rows.append(
                    {
                        "variant": variant,
                        "status": f"error: {msg}",
                        "traceback_tail": traceback.format_exc()[-1500:],
                    }
                )
            dist.barrier()
    finally:
        counter.uninstall()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------
# main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="tiny", help="recipes/model.py preset (tiny, small, ...)")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS)
    )
    p.add_argument("--world-size", type=int, default=2, help="gloo processes")
    p.add_argument("--steps", type=int, default=3, help="training steps; the last is counted")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument(
        "--timeout-s",
        type=int,
        default=120,
        help="gloo timeout: a variant stuck in a collective fails instead of hanging",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default runs/benchmarks/<date>-cpu-comm-PRESET-wN.json)",
    )
    args = p.parse_args()

    variants = [v.strip() for v in args.variants.split(",")]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"bench_comm: unknown variant {v!r}: use {', '.join(VARIANTS)}")
    margs = ModelArgs.from_name(args.preset)
    opts = dict(
        variants=variants,
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        timeout_s=args.timeout_s,
    )
    device = torch.device("cpu")
    info = common.run_info(device)
    info["device"] += f"; {args.world_size} gloo processes, 1 thread each"
    print(f"# {info['device']} | torch {info['torch']} | torchao {info['torchao']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        # fork where there is one: the workers skip re-importing torch (seconds each); the
        # parent has run no torch ops yet, so there is no thread pool to inherit.
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        mp.start_processes(
            worker,
            args=(args.world_size, free_port(), margs, opts, tmp),
            nprocs=args.world_size,
            join=True,
            start_method=method,
        )
        rows = json.loads(Path(tmp, "rank0.json").read_text())

    base = next((r for r in rows if r["variant"] == "bf16" and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] == "ok" and base:
            r["all_gather_ratio_vs_bf16"] = round(
                r["all_gather_bytes"] / base["all_gather_bytes"], 4
            )
            r["total_ratio_vs_bf16"] = round(
                sum(r[f"{k}_bytes"] for k in ("all_gather", "reduce_scatter", "all_reduce"))
                / sum(base[f"{k}_bytes"] for k in ("all_gather", "reduce_scatter", "all_reduce")),
                4,
            )
    n_params = sum(p.numel() for p in Transformer(margs).parameters())
    payload = {
        **info,
        "kind": "comm",
        "preset": args.preset,
        "model_args": dataclasses.asdict(margs),
        "n_params": n_params,
        "world_size": args.world_size,
        "steps": args.steps,
        "counted_step": args.steps,
        "batch_per_rank": args.batch,
        "seq": args.seq,
        "mixed_precision": "param bf16, reduce fp32",
        "per_rank": "rank 0",
        "rows": rows,
    }
    columns = [
        ("variant", "variant"),
        ("status", "status"),
        ("all_gather_bytes", "all-gather B"),
        ("all_gather_calls", "AG calls"),
        ("all_gather_dtypes", "AG dtype"),
        ("reduce_scatter_bytes", "reduce-scatter B"),
        ("reduce_scatter_calls", "RS calls"),
        ("all_reduce_bytes", "all-reduce B"),
        ("all_reduce_calls", "AR calls"),
        ("collectives", "collectives/step"),
        ("all_gather_ratio_vs_bf16", "AG bytes / bf16"),
        ("total_ratio_vs_bf16", "all bytes / bf16"),
        ("final_loss", "loss"),
    ]
    table = common.markdown_table(rows, columns, ndigits=4)
    table += (
        f"\n\nPer training step on rank 0 (step {args.steps} of {args.steps}), preset "
        f"{args.preset} ({n_params:,} params; lm head, norms and embedding stay bf16), "
        f"{args.world_size} ranks, batch {args.batch}x{args.seq} tokens per rank."
    )
    out = args.out or common.default_out(device, "comm", args.preset, f"w{args.world_size}")
    json_path, md_path = common.write_results(
        out, payload, table, "bench_comm: FSDP2 bytes and collectives per step"
    )
    print("\n" + table)
    print(f"\nwrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
