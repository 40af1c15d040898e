"""Tensor parallel through torchtitan 0.3's own ``Module.parallelize`` on float8kit layers:
2 gloo ranks, its dense FFN sharding (w1/w3 colwise, w2 rowwise), the ``partial_dtensor``
backend. Each rank writes ``rank<N>.json`` to ``$FLOAT8KIT_RESULTS`` for
tests/test_integrations_torchtitan.py, comparing with the same model on one process.

    torchrun --nproc-per-node 2 tests/torchtitan_tp.py

torchtitan builds its meshes on its device type, CUDA unless another accelerator is found;
the test sets it to the CPU (gloo), the one change to torchtitan made here.
"""

import json
import os
import sys
from pathlib import Path

import spmd_types as spmd
import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims as parallel_dims_module
from torch.distributed.tensor import DTensor
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common.decoder_sharding import (
    dense_activation_placement,
    set_dense_ffn_sharding,
)
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import sqnr  # noqa: E402

from float8kit import precompute_scales  # noqa: E402
from float8kit.integrations.torchtitan import Float8KitConverter  # noqa: E402

parallel_dims_module.device_type = "cpu"
DIM, HIDDEN = 64, 128
INIT = {"weight": lambda p: torch.nn.init.trunc_normal_(p, std=0.1)}


def ffn(recipe: str | None):
    def linear(i, o):
        return Linear.Config(in_features=i, out_features=o, param_init=INIT)

    cfg = FeedForward.Config(w1=linear(DIM, HIDDEN), w2=linear(HIDDEN, DIM), w3=linear(DIM, HIDDEN))
    x_layout = dense_activation_placement(tp=spmd.R)
    set_dense_ffn_sharding(cfg, attn_x_layout=x_layout, enable_sp=False)
    if recipe is not None:
        cfg = Float8KitConverter.Config(recipe_name=recipe).build().convert(cfg)
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_states()
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def step(model, x, grad):
    x = x.clone().requires_grad_()
    out = full(model(x))
    out.backward(grad)
    precompute_scales(model)
    return out.detach(), x.grad


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = dict(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 16, DIM, generator=g) for _ in range(3)]
    grads = [torch.randn(4, 16, DIM, generator=g) for _ in range(3)]
    hp = ffn(None)
    result = {"rank": rank}
    for recipe in ("tensorwise", "delayed"):
        tp, single = ffn(recipe), ffn(recipe)
        tp.parallelize(ParallelDims(**dims, spmd_backend="partial_dtensor"))
        r = {
            "weights": [
                [type(m.weight).__name__, [str(p) for p in m.weight.placements]]
                for m in (tp.w1, tp.w2, tp.w3)
            ],
            "buffers": sorted({type(b).__name__ for b in tp.buffers()}),
            "out_vs_one_process": [],
            "grad_input_vs_one_process": [],
            "out_vs_hp": [],
            "scales_equal": [],
        }
        for x, grad in zip(xs, grads, strict=True):
            out, gin = step(tp, x, grad)
            ref, ref_gin = step(single, x, grad)
            with torch.no_grad():
                hp_out = hp(x)
            r["out_vs_one_process"].append(sqnr(ref, out))
            r["grad_input_vs_one_process"].append(sqnr(ref_gin, gin))
            r["out_vs_hp"].append(sqnr(hp_out, out))
            # remove_duplicate=False: in one process, DELAYED layers that read one input (w1,
            # w3) share its scale buffers (one float8 copy per shared input)
            scales = {
                n: full(b) for n, b in tp.named_buffers(remove_duplicate=False) if "fp8_scale" in n
            }
            ones = dict(single.named_buffers(remove_duplicate=False))
            r["scales_equal"].append(
                len(scales) and all(torch.equal(v, ones[n]) for n, v in scales.items())
            )
        result[recipe] = r
    out_dir = Path(os.environ["FLOAT8KIT_RESULTS"])
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
