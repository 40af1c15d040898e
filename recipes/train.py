"""Train a small Llama-style byte-level model in high precision, or with float8 linears.

One process (CPU or one GPU):

    python recipes/train.py --preset tiny --float8 none --steps 60
    python recipes/train.py --preset tiny --float8 tensorwise --steps 60
    python recipes/train.py --preset small --float8 rowwise --out runs/small_rowwise
    python recipes/train.py --preset moe-tiny --float8 rowwise  # MoE: float8 grouped experts

Several processes, FSDP2 (gloo on CPU, nccl on GPUs; --batch-size is the global batch):

    python -m torch.distributed.run --nproc_per_node=2 recipes/train.py --preset tiny \
        --float8 tensorwise --steps 5
    torchrun --nproc_per_node=8 recipes/train.py --preset llama3-8b-4l --float8 tensorwise \
        --compile --device cuda

Tensor parallel (with sequence parallel) over --tp ranks, FSDP2 over the rest (2-D mesh):

    python -m torch.distributed.run --nproc_per_node=4 recipes/train.py --preset tiny \
        --float8 tensorwise --tp 2 --steps 5

Expert parallel (MoE presets) over --ep ranks: each rank keeps n_experts / EP experts and the
tokens travel to them (as float8 rows with --float8); FSDP2 shards the rest over every rank:

    python -m torch.distributed.run --nproc_per_node=2 recipes/train.py --preset moe-tiny \
        --float8 rowwise --ep 2 --steps 5

Checkpoint every 30 steps, then continue a run (bitwise the same as never stopping):

    python recipes/train.py --preset tiny --steps 60 --checkpoint-every 30 --out runs/a
    python recipes/train.py --preset tiny --steps 60 --resume runs/a/checkpoints/step_000030 \
        --out runs/b

Outputs: OUT/config.json, OUT/metrics.jsonl (one JSON object per step: step, loss, lr,
grad_norm (the global gradient norm before clipping), tokens_per_s, and val_loss every
--eval-every steps), OUT/checkpoints/step_NNNNNN/ (dcp, plus manifest.json: the sha256 of
every file; --resume verifies it and refuses a corrupt or incomplete checkpoint, naming the
bad file), OUT/monitor.jsonl with --monitor N (every N
steps, each float8 layer's SQNR per gemm: docs/monitor.md). Evaluation runs in eval mode
and never changes the training losses. On CPU each process uses --threads intra-op threads
(default 1).

The float8 part of this file is three statements tagged with a "float8" comment (import,
convert, precompute_scales), plus the optional monitor: without them what is left is the
hp baseline. Under FSDP2, --float8-reduce-scatter adds a fourth, opt-in one: the
gradients' reduce-scatter in float8.
Everything else runs the same in both modes: autocast to the hp dtype over fp32 master
weights (--hp-dtype: bf16 on GPUs and on CPUs with native bf16, fp32 elsewhere; said on the
console and in config.json); the lm head (`output`), MoE routers, norms, attention and the
loss stay in hp; only the Linear gemms inside the blocks (and the MoE experts' grouped gemms)
change. A float8 run says how many layers went float8 and which share of the gemm FLOPs
they carry (console, config.json), and refuses to run with none.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

# Run from a checkout without `pip install`: float8kit sits next to recipes/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli import (  # noqa: E402, F401
    EXPERT_MODES,
    FLOAT8_MODES,
    PRESET_DEFAULTS,
    RECIPE_MODES,
    build_parser,
    linear_recipe,
    parse_args,
)

if __name__ == "__main__":
    # --help and usage errors answer before torch is imported (seconds, tens of them on a
    # busy machine); main() parses again, which costs nothing.
    parse_args()

try:
    from tqdm import tqdm
except ImportError:  # `pip install -e .` installs the library (torch only), not the recipes' needs
    sys.exit("train.py: error: the recipes need their extra: pip install -e '.[recipes]'")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from data import get_batch, load_corpus  # noqa: E402
from model import ModelArgs, Transformer, tp_plan  # noqa: E402
from torch.distributed.checkpoint import DefaultLoadPlanner  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

import float8kit  # noqa: E402  # float8
from float8kit.optim import AdamW4bit, AdamW8bit  # noqa: E402
from float8kit.versions import CPU_HP_DTYPE_ENV, cpu_hp_dtype  # noqa: E402

VAL_SEED = 1234  # the validation windows are the same for every run, whatever --seed says


class UsageError(Exception):
    """Bad input: main() prints it as one line and exits 2, without a traceback."""


# ----------------------------------------------------------------------------
# distributed setup: torchrun sets RANK/WORLD_SIZE; plain `python` runs one process


def setup_distributed(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    device_flag = args.device
    if device_flag == "auto":
        device_flag = "cuda" if torch.cuda.is_available() else "cpu"
    if device_flag == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # Checked before the process group exists: every rank fails alike, nothing hangs.
    for flag, degree in (("--ep", args.ep), ("--tp", args.tp)):
        if degree > 1 and world_size == 1:
            raise UsageError(
                f"{flag} {degree} runs on {degree} processes or more: launch with torchrun "
                f"--nproc-per-node {degree} recipes/train.py ..."
            )
    if args.tp > 1 and args.float8 != "none":
        try:  # the recipe's formats must support tensor parallelism (before anything runs)
            float8kit.formats.require(
                linear_config(args.float8),
                lambda caps: caps.tensor_parallel is not None,
                f"--tp {args.tp} (tensor parallelism)",
                f"use another --float8 recipe with --tp, or --float8 {args.float8} without it",
            )
        except ValueError as e:
            raise UsageError(str(e).removeprefix("float8kit: ")) from None
    n_experts = ModelArgs.from_name(args.preset).n_experts
    if args.float8 in EXPERT_MODES and not n_experts:
        raise UsageError(
            f"--float8 {args.float8} differs from {EXPERT_MODES[args.float8]} in the MoE "
            f"experts only, and {args.preset!r} has none: use --float8 "
            f"{EXPERT_MODES[args.float8]} (or a MoE preset: moe-tiny)"
        )
    if args.ep > 1:
        if not n_experts:
            raise UsageError(
                f"--ep {args.ep} needs a MoE preset (moe-tiny): {args.preset!r} has no experts"
            )
        if args.tp > 1:
            # one model-parallel dimension at a time keeps the mesh and the data split simple
            raise UsageError(
                f"--ep {args.ep} does not combine with --tp {args.tp}: use one of them"
            )
        if world_size % args.ep:
            raise UsageError(f"--ep {args.ep} must divide the {world_size} processes")
        if n_experts % args.ep:
            raise UsageError(
                f"--ep {args.ep} must divide the {n_experts} experts of --preset {args.preset}"
            )
    if args.tp > 1 and n_experts:
        # model.tp_plan shards dense feed-forwards; experts would need expert parallelism
        raise UsageError(f"--tp > 1 is not supported with the MoE preset {args.preset!r}")
    if world_size % args.tp:
        raise UsageError(f"--tp {args.tp} must divide the {world_size} processes")
    if args.float8_reduce_scatter and world_size // args.tp < 2:
        raise UsageError(
            "--float8-reduce-scatter changes FSDP2's gradient reduce-scatter: run with at "
            "least 2 data-parallel processes (torchrun --nproc_per_node=2, more than --tp)"
        )
    if args.seq_len % args.tp:
        raise UsageError(
            f"--seq-len {args.seq_len} must be divisible by --tp {args.tp} (sequence parallel "
            "splits every sequence evenly over the tensor-parallel ranks)"
        )
    if args.batch_size % (world_size // args.tp):
        ranks = (
            f"{world_size} processes"
            if args.tp == 1
            else f"{world_size // args.tp} data-parallel ranks (processes / --tp)"
        )
        raise UsageError(f"--batch-size {args.batch_size} must be divisible by the {ranks}")
    if world_size == 1:
        return 0, 1, torch.device(device_flag)
    local_rank = int(os.environ["LOCAL_RANK"])
    if device_flag == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_flag == "cuda" else "gloo")
    device = torch.device("cuda", local_rank) if device_flag == "cuda" else torch.device("cpu")
    return dist.get_rank(), world_size, device


def data_shard(rank: int, args: argparse.Namespace) -> tuple[int, int]:
    """(index, count) of this rank's slice of the global batch: the tensor-parallel ranks of
    one data-parallel group (consecutive ranks: the mesh's last dim) share their slice."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return rank // args.tp, world_size // args.tp


def print0(*args, **kwargs) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        tqdm.write(" ".join(str(a) for a in args), **kwargs)


# ----------------------------------------------------------------------------
# model: build, convert to float8, shard


# The NVFP4 recipe keeps this share of its float8 Linears, the last ones, in hp (the paper's
# ~15%: float8kit.hp_tail_filter); nvfp4_no_tail converts them too.
NVFP4_HP_TAIL = 0.15


def linear_config(mode: str) -> float8kit.Float8LinearConfig:
    """The Float8LinearConfig of a --float8 mode: the named recipe, or nvfp4 less a part."""
    if mode == "nvfp4_no_rht":
        return float8kit.nvfp4_config(hadamard=False)
    if mode == "nvfp4_no_sr":
        return float8kit.nvfp4_config(stochastic_rounding=False)
    return float8kit.Float8LinearConfig.from_recipe_name(linear_recipe(mode))


def layer_filter(args: argparse.Namespace, config, tokens: int | None = None, model=None):
    """The Linears that go float8: float8kit's default filter for the recipe (or, with
    --filter auto, the predicted winners at ``tokens`` per step and rank), minus the
    modules whose name contains one of --filter-fqns; for the nvfp4 modes with a tail
    (given the ``model``), minus the last NVFP4_HP_TAIL of the layers left."""
    skip = [f for f in args.filter_fqns.split(",") if f]
    auto = None
    if getattr(args, "filter", "default") == "auto":
        auto = float8kit.auto_module_filter(
            linear_recipe(args.float8),
            device=args.filter_device,
            tokens=tokens or args.batch_size * args.seq_len,
        )

    def keep_float8(mod: torch.nn.Module, fqn: str) -> bool:
        if any(f in fqn for f in skip):
            return False
        if auto is not None:
            return auto(mod, fqn)
        return float8kit.default_module_filter(mod, fqn, config)

    if model is not None and args.float8.startswith("nvfp4") and args.float8 != "nvfp4_no_tail":
        return float8kit.hp_tail_filter(model, NVFP4_HP_TAIL, base=keep_float8)
    return keep_float8


def experts_config(mode: str, ep: int = 1) -> float8kit.Float8ExpertsConfig:
    """The MoE experts' grouped-gemm config for --float8: MX blocks for mxfp8 (and
    mxfp8_wgrad_with_hp, its weight-gradient gemm in hp), rowwise (the float8 grouped kernel's
    scales, Float8ExpertsConfig's default) for every other recipe, rowwise_with_gw_hp's with
    the weight-gradient gemm in hp as its Linears'. Under --ep the tokens reach their experts
    as float8 rows, with no hp copy: the weight-gradient gemm then takes the dequantized rows
    (exact: power-of-two scales)."""
    name = mode if mode.startswith("mxfp8") else "rowwise"
    config = float8kit.Float8ExpertsConfig.from_recipe_name(name)
    if mode == "rowwise_with_gw_hp":
        config = replace(config, wgrad_with_hp=True)
    return replace(config, wgrad_operands="dequantized") if ep > 1 else config


def build_model(
    args: argparse.Namespace, device: torch.device, world_size: int, fp8_all_gather: bool
) -> torch.nn.Module:
    torch.manual_seed(args.seed)  # same init on every rank and in every --float8 mode
    margs = ModelArgs.from_name(args.preset)
    margs = replace(margs, max_seq_len=max(margs.max_seq_len, args.seq_len))
    with device:
        model = Transformer(margs)
    ep = args.ep if world_size > 1 else 1  # --memory builds the one-process model
    if ep > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from float8kit.distributed.expert_parallel import EPConfig

        # Ranks (i, j) of the (dp, ep) mesh: each row of ep consecutive ranks splits the
        # experts (rank j keeps experts [j * E / ep, (j + 1) * E / ep)); each column holds
        # the same experts, which FSDP2 shards over it (below). Before the float8 conversion:
        # it converts the experts each rank keeps.
        ep_mesh = init_device_mesh(device.type, (world_size // ep, ep), mesh_dim_names=("dp", "ep"))
        comm = EPConfig(comm="hp" if args.float8 == "none" else "float8")
        for block in model.layers:
            block.feed_forward.shard_experts(ep_mesh["ep"].get_group(), comm)
    # Convert before FSDP wraps the model, as torchtitan does: FSDP then shards the
    # Float8Linear weights and (tensorwise) all-gathers them as fp8.
    if args.float8 != "none":
        config = replace(linear_config(args.float8), enable_fsdp_float8_all_gather=fp8_all_gather)
        float8kit.convert_experts_to_float8_training(  # float8: Linears (no head/router), experts
            float8kit.convert_to_float8_training(
                model,
                config=config,
                module_filter_fn=layer_filter(
                    args, config, args.batch_size * args.seq_len // (world_size // args.tp), model
                ),
            ),
            config=experts_config(args.float8, ep),
        )
    if args.recompute_norms:
        float8kit.recompute_norms(model)
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        dp = world_size // args.tp
        mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
        if args.tp > 1:
            # float8kit's styles all-gather float8 activations; they need a DYNAMIC
            # tensorwise or rowwise input cast, so delayed, blockwise, mxfp8 (and bf16) runs use
            # torch's styles.
            float8_styles = args.float8 in ("tensorwise", "rowwise", "rowwise_with_gw_hp")
            parallelize_module(model, mesh["tp"], tp_plan(model, float8_styles))
        # hp compute weights, fp32 gradient reduction: the same dtypes autocast gives the
        # single-process run, so 1 and N processes train the same model.
        mp = MixedPrecisionPolicy(param_dtype=hp_dtype(args, device), reduce_dtype=torch.float32)
        if dp > 1:
            experts: set[torch.nn.Parameter] = set()
            for block in model.layers:
                if ep > 1:
                    experts |= fsdp_experts(block.feed_forward, mesh["dp"], ep_mesh["dp"], mp)
                fully_shard(block, mesh=mesh["dp"], mp_policy=mp, ignored_params=experts or None)
            fully_shard(model, mesh=mesh["dp"], mp_policy=mp, ignored_params=experts or None)
            if args.float8_reduce_scatter:  # opt-in: float8 gradient reduce-scatter (qgZ)
                float8kit.enable_float8_reduce_scatter(model)
    return model


def fsdp_experts(moe: torch.nn.Module, mesh, expert_mesh, mp) -> set[torch.nn.Parameter]:
    """FSDP2 for one MoE layer's local experts under --ep; returns the parameters its block's
    FSDP2 unit must leave alone.

    The gradient scale: each rank's loss is the mean over its own tokens, and FSDP2 divides
    the dense gradients by the world size (the mean over ranks). An expert's gradient on its
    rank already sums the contributions of the tokens of its whole expert-parallel group
    (the combine's backward brings them), so over the ranks holding the same experts it
    must be summed, then divided by the world size too, not by that group's size."""
    from torch.distributed.fsdp import fully_shard

    world = mesh.size()
    experts = {moe.w1, moe.w2, moe.w3}
    if expert_mesh.size() == 1:
        # --ep = world size: one copy of each expert, nothing to shard or reduce
        for w in experts:
            w.register_hook(lambda grad: grad / world)
        return experts
    # The router is dense (every rank's tokens): its own unit over every rank, so that the
    # experts' unit over expert_mesh holds nothing else.
    fully_shard(moe.router, mesh=mesh, mp_policy=mp)
    fully_shard(moe, mesh=expert_mesh, mp_policy=mp)
    moe.set_gradient_divide_factor(world)
    if dist.get_backend() == "gloo":  # a custom factor is a PREMUL_SUM, which gloo lacks:
        moe.set_force_sum_reduction_for_comms(True)  # SUM, then divide
    return set()


def clip_grad_norm(model: torch.nn.Module, max_norm: float, ep: int) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over every rank's gradients; returns the global norm
    before clipping. Under --ep the gradients live on two meshes (or outside FSDP2): each
    rank holds a distinct piece of the whole (its FSDP2 shards; its experts, or their
    shards), so the squared norm is the sum over all ranks of the local pieces' squares."""
    if ep == 1:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    sq = sum(torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in local)
    dist.all_reduce(sq)
    coef = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)  # clip_grad_norm_'s rule
    for g in local:
        g.mul_(coef.to(g.dtype))
    return sq.sqrt()


def n_params(model: torch.nn.Module, ep: int) -> int:
    """The model's parameter count; under --ep each rank holds 1 / ep of the experts."""
    n = sum(p.numel() for p in model.parameters())
    if ep > 1:
        n += (ep - 1) * sum(
            sum(w.numel() for w in (b.feed_forward.w1, b.feed_forward.w2, b.feed_forward.w3))
            for b in model.layers
        )
    return n


def float8_coverage(model: torch.nn.Module) -> dict:
    """How much of the model runs float8: the Linears converted out of all of them (the lm
    head included), the MoE expert weights converted, and the share of the gemm FLOPs per
    token they carry (a Linear in x out multiply-adds; an expert weight top_k x in x out, as
    each token visits top_k experts). Attention's SDPA and the loss are not counted."""
    linears = fp8_linears = experts = fp8_experts = 0
    flops = fp8_flops = 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            is_fp8 = isinstance(mod, float8kit.Float8Linear)
            linears, fp8_linears = linears + 1, fp8_linears + is_fp8
            flops += mod.in_features * mod.out_features
            fp8_flops += is_fp8 * mod.in_features * mod.out_features
        elif hasattr(mod, "top_k") and hasattr(mod, "w1"):  # model.MoEFeedForward
            for w in (mod.w1, mod.w2, mod.w3):
                local = getattr(w, "_local_tensor", w)  # under FSDP2 a DTensor
                is_fp8 = isinstance(w, float8kit.Float8ExpertWeight) or isinstance(
                    local, float8kit.Float8ExpertWeight
                )
                experts, fp8_experts = experts + 1, fp8_experts + is_fp8
                n = mod.top_k * w.shape[-2] * w.shape[-1]
                flops, fp8_flops = flops + n, fp8_flops + is_fp8 * n
    return {
        "linears": fp8_linears,
        "linears_total": linears,
        "expert_weights": fp8_experts,
        "expert_weights_total": experts,
        "gemm_flops_share": fp8_flops / flops if flops else 0.0,
    }


def describe_coverage(c: dict) -> str:
    text = f"{c['linears']} of {c['linears_total']} Linears"
    if c["expert_weights_total"]:
        text += f", {c['expert_weights']} of {c['expert_weights_total']} expert weights"
    return text + f", {100 * c['gemm_flops_share']:.1f}% of the gemm FLOPs"


def setup_model(args, device, world_size) -> tuple[torch.nn.Module, bool]:
    # float8 all-gather for every recipe, on a 1-D or a 2-D (dp, tp) mesh (docs/fsdp.md),
    # except with --monitor, which measures against the hp weight
    fp8_all_gather = world_size > args.tp and args.float8 != "none" and not args.monitor
    if fp8_all_gather:  # a recipe whose config refuses it (this version: mxfp8) gathers hp
        recipe = linear_config(args.float8)
        try:
            replace(recipe, enable_fsdp_float8_all_gather=True)
        except ValueError:
            fp8_all_gather = False
    return build_model(args, device, world_size, fp8_all_gather), fp8_all_gather


def hp_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    """The dtype the hp parts compute in (--hp-dtype). auto: bf16 on a GPU; on a CPU
    float8kit.versions.cpu_hp_dtype(), bf16 where the CPU has it natively, else fp32 (an
    emulated bf16 matmul runs many times slower than fp32; FLOAT8KIT_CPU_HP_DTYPE overrides)."""
    if args.hp_dtype != "auto":
        return getattr(torch, args.hp_dtype)
    return torch.bfloat16 if device.type == "cuda" else cpu_hp_dtype()


def autocast(device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """Autocast to ``dtype`` over the fp32 master weights; fp32 is no autocast at all."""
    if dtype == torch.float32:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def reshard(model: torch.nn.Module) -> None:
    # FSDP2 leaves the root's parameters unsharded after a forward that has no backward
    # (eval); left so, the next step would train on stale weights.
    if hasattr(model, "reshard"):
        model.reshard()


# ----------------------------------------------------------------------------
# learning rate: linear warmup, then cosine down to 10% of the peak


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


# ----------------------------------------------------------------------------
# checkpoints: torch.distributed.checkpoint (sharded under FSDP, also fine in one process)

# A resumed run must match the flags that shaped the original trajectory.
RESUME_KEYS = (
    "preset",
    "float8",
    "steps",
    "batch_size",
    "seq_len",
    "lr",
    "warmup",
    "weight_decay",
    "optim",
    "grad_clip",
    "seed",
)


MANIFEST = "manifest.json"  # sha256 and size of every file of a checkpoint, written last


def save_checkpoint(
    path: Path,
    model,
    optimizer,
    step: int,
    gen: torch.Generator,
    meta: dict,
    rank: int,
    world_size: int,
) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "train": {
            "step": step,
            "data_rng": gen.get_state(),
            "meta": json.dumps(meta),
            **rng_states(),
        },
    }
    with quiet_single_process():
        dcp.save(state, checkpoint_id=str(path))
    # dcp.save returns once every rank's files and .metadata are written; the manifest
    # comes last, so a checkpoint without one is incomplete and is never resumed from.
    if rank == 0:
        write_manifest(path)
    if world_size > 1:
        dist.barrier()


@contextmanager
def quiet_single_process():
    # Without a process group dcp warns that it assumes one process: that is what we want.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(path: Path) -> None:
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.name != MANIFEST)
    entries = {
        f.relative_to(path).as_posix(): {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        for f in files
    }
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": entries}, indent=1) + "\n")
    tmp.replace(path / MANIFEST)  # atomic: a manifest is whole or absent


def verify_checkpoint(path: Path) -> str | None:
    """None if every file of the checkpoint matches its manifest, else what is wrong."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return (
            f"{path} has no {MANIFEST}: its save did not finish (or an older train.py "
            "wrote it); refusing to resume from a checkpoint that cannot be verified"
        )
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"{manifest} is unreadable ({e})"
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"{f} has {size} bytes, the manifest says {want['bytes']}: corrupt checkpoint"
        if _sha256(f) != want["sha256"]:
            return f"{f} does not match its sha256 in {MANIFEST}: corrupt checkpoint"
    return None


def find_checkpoint(path: str) -> Path:
    p = Path(path)
    if (p / ".metadata").is_file():
        return p
    found = sorted((p / "checkpoints").glob("step_*/.metadata"))
    complete = [f.parent for f in found if (f.parent / MANIFEST).is_file()]
    if not found:
        raise UsageError(
            f"--resume {path}: no checkpoint there (expected a folder with "
            ".metadata, or a run folder with checkpoints/step_*)"
        )
    if not complete:
        raise UsageError(
            f"--resume {path}: no complete checkpoint there (none has a "
            f"{MANIFEST}: their saves did not finish)"
        )
    return complete[-1]


def load_checkpoint(
    path: Path, model, optimizer, gen: torch.Generator, meta: dict, rank: int, world_size: int
) -> int:
    # Verify the files first (rank 0 reads them; every rank gets the verdict, so all fail
    # alike), then the flags, then load: a mismatch is reported before any model key.
    problem = [verify_checkpoint(path) if rank == 0 else None]
    if world_size > 1:
        dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise UsageError(f"--resume: {problem[0]}")
    train_state = {"train": {"step": 0, "data_rng": gen.get_state(), "meta": "", **rng_states()}}
    with quiet_single_process():
        # (partial: a checkpoint from before the random states were saved has none)
        dcp.load(train_state, checkpoint_id=str(path), planner=DefaultLoadPlanner(True))
    saved = json.loads(train_state["train"]["meta"])
    for k, v in saved.items():
        if meta.get(k) != v:
            why = ""
            if k == "steps":  # the one a user changes to train longer
                why = (
                    ": the learning rate follows a warmup and cosine decay over --steps, so "
                    "other --steps would change the schedule of the steps already taken; to "
                    "train longer, start the run with the final --steps (an interrupted run "
                    "resumes to it)"
                )
            raise UsageError(
                f"--resume {path}: checkpoint has {k}={v!r}, this run {meta.get(k)!r}{why}"
            )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with quiet_single_process():
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    gen.set_state(train_state["train"]["data_rng"])
    torch.set_rng_state(train_state["train"]["torch_rng"])
    if "cuda_rng" in train_state["train"]:
        torch.cuda.set_rng_state(train_state["train"]["cuda_rng"])
    return int(train_state["train"]["step"])


def rng_states() -> dict[str, torch.Tensor]:
    """torch's default generators' states (CPU, and the current GPU's): the stream NVFP4's
    stochastic rounding draws from, saved with a checkpoint so that a resumed run continues
    it (every rank seeds alike and draws alike, so rank 0's state is every rank's)."""
    states = {"torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda_rng"] = torch.cuda.get_rng_state()
    return states


# ----------------------------------------------------------------------------
# evaluation: mean loss over fixed validation windows (identical across runs and ranks)


@torch.no_grad()
def evaluate(model, fwd, val: torch.Tensor, args, device, rank: int, world_size: int) -> float:
    # eval mode: layers with state that training updates (float8 delayed scaling records
    # amaxes in train mode) must not learn from validation batches. Evaluating never
    # changes the training trajectory.
    model.eval()
    gen = torch.Generator().manual_seed(VAL_SEED)
    total = torch.zeros((), device=device)
    try:
        for _ in range(args.eval_batches):
            x, y = get_batch(val, args.batch_size, args.seq_len, gen, *data_shard(rank, args))
            with autocast(device, hp_dtype(args, device)):
                total += fwd(x.to(device), y.to(device)).float()
    finally:
        model.train()
    reshard(model)
    if world_size > 1:
        dist.all_reduce(total)
    return (total / (args.eval_batches * world_size)).item()


# ----------------------------------------------------------------------------
# training


def check_out(args: argparse.Namespace) -> None:
    """Refuse an --out that holds a run unless --overwrite (which clears it) or --resume."""
    out = Path(args.out)
    held = [n for n in ("metrics.jsonl", "checkpoints") if (out / n).exists()]
    if not held or args.resume:
        return
    if not args.overwrite:
        steps = 0
        if (out / "metrics.jsonl").exists():
            steps = len((out / "metrics.jsonl").read_text().splitlines())
        # a run to continue: one with a complete checkpoint (its .metadata is written last)
        resumable = any((out / "checkpoints").glob("step_*/.metadata"))
        raise UsageError(
            f"--out {out} already holds a run ({steps} steps logged"
            + (", checkpoints" if resumable else ", no checkpoint")
            + "): pass --overwrite to replace it, "
            + (f"--resume {out} to continue it, " if resumable else "")
            + "or another --out"
        )
    if int(os.environ.get("RANK", "0")) == 0 and (out / "checkpoints").exists():
        # an old checkpoint left beside the new run would be what --resume OUT picks up
        import shutil

        shutil.rmtree(out / "checkpoints")


def setup_monitor(args, fwd, out: Path, start: int, rank: int):
    """float8kit.Float8Monitor on the module the loop calls, numbering steps as
    metrics.jsonl does (step N = the N-th optimizer step); None without --monitor."""
    if not args.monitor:
        return None
    if args.float8 == "none":
        print0("--monitor: --float8 none has no float8 layer to measure")
        return None
    path = out / "monitor.jsonl"
    if rank == 0 and path.exists():  # a resumed run keeps the rows up to its checkpoint
        rows = [r for r in map(json.loads, path.read_text().splitlines()) if r["step"] <= start]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monitor = float8kit.Float8Monitor(fwd, every=args.monitor, log_path=path)
    monitor.step = start  # the next forward is step start + 1
    return monitor


def train(args: argparse.Namespace) -> list[dict]:
    """Runs one training job; returns the per-step metrics (also in OUT/metrics.jsonl)."""
    # -- setup; any bad input surfaces here as UsageError/OSError/ValueError
    if args.threads:
        torch.set_num_threads(args.threads)
    check_out(args)  # before the process group: every rank refuses alike, nothing hangs
    rank, world_size, device = setup_distributed(args)
    try:
        corpus = load_corpus(args.data)
    except ValueError as e:
        raise UsageError(str(e)) from None
    shortest = min(len(corpus.train), len(corpus.val))
    if args.seq_len >= shortest:
        raise UsageError(
            f"--seq-len {args.seq_len} is longer than the data: the smaller split "
            f"of {corpus.source} has {shortest} bytes"
        )
    print0(corpus.describe())
    dtype = hp_dtype(args, device)
    if args.hp_dtype != "auto":
        how = "--hp-dtype"
    elif device.type == "cuda":
        how = "auto: a GPU"
    elif os.environ.get(CPU_HP_DTYPE_ENV):
        how = f"auto: {CPU_HP_DTYPE_ENV}={os.environ[CPU_HP_DTYPE_ENV]}"
    else:
        native = dtype == torch.bfloat16
        how = f"auto: this CPU {'has' if native else 'has no'} native bf16"
    print0(f"hp dtype: {str(dtype).removeprefix('torch.')} ({how})")
    try:
        model, fp8_all_gather = setup_model(args, device, world_size)
    except (ValueError, KeyError, NotImplementedError) as e:
        if args.float8 == "none":
            raise
        raise UsageError(f"--float8 {args.float8}: {e}") from None  # e.g. a recipe not built yet
    coverage = float8_coverage(model)
    if args.float8 != "none":
        if not coverage["linears"] and not coverage["expert_weights"]:
            # a run labelled float8 that is the hp baseline would mislead every comparison
            why = (
                "--filter auto predicts none of them faster in float8 on "
                f"--filter-device {args.filter_device} at this run's tokens per step"
                if args.filter == "auto"
                else "the filter (--filter-fqns, float8kit's default dims check) keeps all in hp"
            )
            raise UsageError(
                f"--float8 {args.float8}: no layer runs float8 ({describe_coverage(coverage)}"
                f"): {why}. Use --filter default, fewer --filter-fqns, a preset with larger "
                "layers (or more tokens per step for --filter auto), or --float8 none"
            )
        print0(f"float8 ({args.float8}): {describe_coverage(coverage)}")
    # Decay matrices only: norms' gains (and nothing else here) are left alone, as in nanoGPT.
    params = [p for p in model.parameters() if p.requires_grad]
    optimizers = {"adamw": torch.optim.AdamW, "adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit}
    low_bit = {}
    if args.optim != "adamw" and args.tp > 1:
        # tensor parallel rowwise weights whose shards are not whole state blocks: fp32 states
        low_bit = {"cut_blocks": "fp32"}
        print0(f"--optim {args.optim} with --tp: rowwise-parallel weights whose shards cut its "
               "128-element blocks keep fp32 states")  # fmt: skip
    optimizer = optimizers[args.optim](
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        **low_bit,
    )
    gen = torch.Generator().manual_seed(args.seed)  # the whole data state of a run
    # Not world_size: batches are drawn globally, so a run may resume on more or fewer ranks.
    meta = {k: getattr(args, k) for k in RESUME_KEYS} | {
        "data_sha256": corpus.sha256,
        "hp_dtype": str(dtype).removeprefix("torch."),
    }
    start = 0
    if args.resume:
        ckpt = find_checkpoint(args.resume)
        start = load_checkpoint(ckpt, model, optimizer, gen, meta, rank, world_size)
        print0(f"resumed from {ckpt} at step {start}")
    # Compile after loading: checkpoints see the plain module's parameter names.
    fwd = model
    if args.compile and args.tp > 1:
        # Tensor parallel: each block is compiled on its own (in place: the parameter names
        # do not change), as torchtitan does; the embedding, final norm, head and loss run
        # eager. Compiling the whole model fails under FSDP2 x TP in torch 2.13: after
        # graph breaks at FSDP2's hooks it stops at the TP embedding (torch's
        # RowwiseParallel on nn.Embedding, its mask buffer: "Mixing fake modes NYI";
        # docs/tp.md). fullgraph: a float8 activation (the sequence-parallel all-gather's
        # output) must not leave a graph through a break, or the backward fails in
        # AOTAutograd.
        for block in model.layers:
            block.compile(fullgraph=True)
    elif args.compile:
        fwd = torch.compile(model)

    out = Path(args.out)
    records: list[dict] = []
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        config = {
            "args": vars(args),
            "model": asdict(model.args),
            "world_size": world_size,
            "fsdp_float8_all_gather": fp8_all_gather,
            "hp_dtype": str(dtype).removeprefix("torch."),
            "float8_layers": coverage,
            "device": str(device),
            "torch": torch.__version__,
            "float8kit": getattr(float8kit, "__version__", "?"),
            "data": {
                "source": corpus.source,
                "files": corpus.n_files,
                "bytes": corpus.n_bytes,
                "sha256": corpus.sha256,
            },
            "n_params": n_params(model, args.ep),
            "threads": torch.get_num_threads(),
        }
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        # On resume keep the steps up to the checkpoint and drop any logged after it.
        mpath = out / "metrics.jsonl"
        if start and mpath.exists():
            records = [
                r for r in map(json.loads, mpath.read_text().splitlines()) if r["step"] <= start
            ]
        mpath.write_text("".join(json.dumps(r) + "\n" for r in records))
    metrics = open(out / "metrics.jsonl", "a") if rank == 0 else None
    monitor = setup_monitor(args, fwd, out, start, rank)  # float8: optional, per-layer numerics

    # -- the loop
    tokens_per_step = args.batch_size * args.seq_len
    # A progress bar on a terminal; plain lines every --log-every steps elsewhere (a bar's
    # carriage returns would fill a log file).
    bar_on = rank == 0 and not args.quiet and sys.stderr.isatty()
    lines_on = rank == 0 and not args.quiet and not bar_on
    bar = tqdm(
        range(start, args.steps),
        initial=start,
        total=args.steps,
        dynamic_ncols=True,
        disable=not bar_on,
        desc=f"{args.preset}/{args.float8}",
    )
    for step in bar:
        t0 = time.perf_counter()
        if args.hp_forward_after and step >= args.hp_forward_after:
            # the forward gemms in hp from here on (a resumed run switches at its first step)
            if float8kit.set_hp_forward(model):
                print0(f"step {step + 1}: forward gemms in hp from here on (--hp-forward-after)")
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(corpus.train, args.batch_size, args.seq_len, gen, *data_shard(rank, args))
        with autocast(device, dtype):
            loss = fwd(x.to(device), y.to(device))
        loss.backward()
        grad_norm = clip_grad_norm(model, args.grad_clip, args.ep)
        optimizer.step()
        float8kit.precompute_scales(model)  # float8: next step's scales, one collective
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        if world_size > 1:  # for logging only (TP ranks hold equal losses): FSDP averaged grads
            dist.all_reduce(loss)
            loss /= world_size
        loss_val = loss.item()  # also syncs the device, so the timing below is real
        dt = time.perf_counter() - t0
        rec = {
            "step": step + 1,
            "loss": loss_val,
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_s": tokens_per_step / dt,
        }
        if not math.isfinite(loss_val):
            raise FloatingPointError(f"loss is {loss_val} at step {step + 1}")
        last = step + 1 == args.steps
        if last or (args.eval_every and (step + 1) % args.eval_every == 0):
            rec["val_loss"] = evaluate(model, fwd, corpus.val, args, device, rank, world_size)
            print0(f"step {step + 1}: train loss {loss_val:.4f}, val loss {rec['val_loss']:.4f}")
        if metrics:
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
        records.append(rec)
        bar.set_postfix(loss=f"{loss_val:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
        if lines_on and ((step + 1) % args.log_every == 0 or last):
            print0(
                f"{args.preset}/{args.float8} step {step + 1}/{args.steps}: "
                f"loss {loss_val:.4f}, {rec['tokens_per_s']:.0f} tokens/s"
            )
        if args.checkpoint_every and ((step + 1) % args.checkpoint_every == 0 or last):
            save_checkpoint(
                out / "checkpoints" / f"step_{step + 1:06d}",
                model,
                optimizer,
                step + 1,
                gen,
                meta,
                rank,
                world_size,
            )
    bar.close()
    if metrics:
        metrics.close()
    if monitor is not None and monitor.report():
        w = monitor.worst(1)[0]
        print0(
            f"monitor: lowest SQNR at step {w['step']}: {w['layer']} {w['gemm']} "
            f"{w['sqnr_db']:.1f} dB (all layers: {out}/monitor.jsonl)"
        )
    print0(
        f"wrote {out}/ (config.json, metrics.jsonl"
        + (", monitor.jsonl" if monitor is not None else "")
        + (", checkpoints/)" if args.checkpoint_every else ")")
    )
    return records


def _storages(t: torch.Tensor):
    # a float8 tensor's memory is its inner tensors (fp8 data, scales), not the hp size
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.nn.Parameter:
        for name in t.__tensor_flatten__()[0]:
            yield from _storages(getattr(t, name))
    else:
        yield t


def activation_bytes(args: argparse.Namespace) -> int:
    """Bytes the tensors autograd saves in one forward of this model on a batch of random
    tokens take (each storage once, a float8 tensor by its fp8 bytes; parameters excluded)."""
    model, _ = setup_model(args, torch.device("cpu"), 1)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        for inner in _storages(t):
            if (ptr := inner.untyped_storage().data_ptr()) not in skip:
                seen[ptr] = inner.untyped_storage().nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (args.batch_size, args.seq_len), generator=g) for _ in "xy")
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        autocast(torch.device("cpu"), torch.bfloat16),  # the bytes of a bf16 step
    ):
        model(x, y).backward()
    return sum(seen.values())


def memory_report(args: argparse.Namespace) -> str:
    """--memory: activation bytes per recipe, measured here (CPU, one process)."""
    tokens = args.batch_size * args.seq_len
    modes = RECIPE_MODES if args.float8 == "none" else [args.float8]
    runs = [(mode, norms) for mode in ["none", *modes] for norms in (False, True)]
    lines = [f"activation bytes kept for backward, {args.preset}, {tokens} tokens:"]
    ref = None
    for mode, norms in runs:
        n = activation_bytes(
            argparse.Namespace(**{**vars(args), "float8": mode, "recompute_norms": norms})
        )
        ref = ref or n
        label = ("bf16" if mode == "none" else mode) + (" + recompute_norms" if norms else "")
        lines.append(
            f"  {label:<40} {n / 2**20:8.2f} MiB  {n / tokens:8.0f} B/token  {n / ref:.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.memory:
        print(memory_report(args))
        return []
    try:
        records = train(args)
        if dist.is_initialized():
            # no rank tears gloo down while another is still in a collective: without it a
            # finished run sometimes aborted at exit ("terminate called without an active
            # exception") after writing everything
            dist.barrier()
        return records
    except UsageError as e:
        # Usage errors are the same on every rank: rank 0 says it. Under torchrun the other
        # ranks wait to be stopped: one that exited first would have torchrun stop rank 0,
        # sometimes before it printed (torchrun stops every rank once rank 0 exits).
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"train.py: error: {e}", file=sys.stderr)
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(60)
        sys.exit(2)
    except OSError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Everything is written and the process group destroyed. Under load, gloo's worker
        # threads can still hold work objects that reference tensors when the interpreter
        # finalizes, and the process then aborts ("terminate called without an active
        # exception", SIGABRT): torchrun would report a finished run as failed. Skip the
        # finalization.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
