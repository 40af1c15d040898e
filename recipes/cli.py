"""train.py's command line: its flags, the per-preset defaults and their validation.

Importable without torch, so ``--help`` and a usage error answer at once: importing torch
takes seconds (tens of them on a busy 2-core machine), and train.py and compare.py parse and
validate their arguments before they import it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FLOAT8_MODES = [
    "none",
    "tensorwise",
    "rowwise",
    "rowwise_with_gw_hp",
    "delayed",
    "blockwise",
    "mxfp8",
    "mxfp8_wgrad_with_hp",
    "nvfp4",
    # the nvfp4 recipe less one of its parts (ablations: what each part buys)
    "nvfp4_no_rht",
    "nvfp4_no_sr",
    "nvfp4_no_tail",
]
# --float8 modes that differ from a named recipe in the MoE experts only: that recipe's linears
# (mxfp8_wgrad_with_hp: MXFP8 experts with the weight-gradient gemm in hp, torchao's
# mxfp8_rceil_wgrad_with_hp)
EXPERT_MODES = {"mxfp8_wgrad_with_hp": "mxfp8"}
# --optim: torch's AdamW, or float8kit.optim's block-quantized ones
OPTIMIZERS = ["adamw", "adamw8bit", "adamw4bit"]
# --float8 modes that are a named recipe (Float8LinearConfig.from_recipe_name)
RECIPE_MODES = [
    m for m in FLOAT8_MODES if m != "none" and "_no_" not in m and m not in EXPERT_MODES
]


def linear_recipe(mode: str) -> str:
    """The named recipe of a --float8 mode's Linears (nvfp4 for its ablations)."""
    return EXPERT_MODES.get(mode, mode.split("_no_")[0])


HP_DTYPES = ["auto", "bfloat16", "float32"]
DESCRIPTION = (
    "Train a small Llama-style byte-level model in high precision (bf16 or fp32), or with "
    "float8 linears via float8kit."
)
# Per-preset defaults for the flags left unset (keys: recipes/model.py's PRESETS): tiny steps
# in ~0.1 s on one CPU core, small makes compare.py a demo of minutes on 2 cores, also in fp32
# (100 steps: 3 seeds x 2 modes within 3 min on a slow AVX2-only CPU); 1b and
# llama3-8b-4l are for GPUs.
PRESET_DEFAULTS = {
    "tiny": dict(batch_size=8, seq_len=128, lr=3e-3, steps=60),
    "small": dict(batch_size=16, seq_len=128, lr=2e-3, steps=100),
    "moe-tiny": dict(batch_size=8, seq_len=128, lr=3e-3, steps=40),
    "1b": dict(batch_size=8, seq_len=2048, lr=3e-4, steps=100),
    "llama3-8b-4l": dict(batch_size=8, seq_len=4096, lr=3e-4, steps=50),
}


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error said in one line (exit 2)."""

    def error(self, message: str):  # one line instead of argparse's usage block
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _preset_default(key: str) -> str:
    """``--help`` text of a flag whose default depends on the preset."""
    return "default: " + ", ".join(f"{name} {d[key]}" for name, d in PRESET_DEFAULTS.items())


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="train.py", description=DESCRIPTION)
    p.add_argument(
        "--preset",
        default="tiny",
        choices=list(PRESET_DEFAULTS),
        help="model size (recipes/model.py); also picks the defaults below",
    )
    p.add_argument(
        "--float8",
        default="none",
        choices=FLOAT8_MODES,
        help="float8kit recipe for the block Linears (MoE experts: MX grouped gemms with "
        "mxfp8, rowwise in every other float8 mode); none = the hp baseline (--hp-dtype); "
        "nvfp4 keeps the last 15%% of the float8 Linears in hp (the NVFP4 recipe's tail); "
        "nvfp4_no_rht / _no_sr / _no_tail: nvfp4 without its Hadamard transform, its "
        "stochastic rounding, its hp tail",
    )
    p.add_argument(
        "--hp-forward-after",
        type=int,
        default=0,
        help="nvfp4 modes: after this many steps run the forward gemms in hp (the NVFP4 "
        "paper's late-training switch; backward gemms stay NVFP4); 0 = never",
    )
    p.add_argument(
        "--hp-dtype",
        default="auto",
        choices=HP_DTYPES,
        help="the high-precision compute dtype (autocast; FSDP2's param dtype): auto = "
        "bfloat16 on a GPU, and on a CPU bfloat16 where it has native bf16 (AVX512-BF16 or "
        "AMX), else float32 (emulated bf16 matmuls run many times slower than fp32); "
        "float32 = no autocast",
    )
    p.add_argument("--steps", type=int, help=f"optimizer steps ({_preset_default('steps')})")
    p.add_argument(
        "--batch-size",
        type=int,
        help="global batch in sequences, split evenly over ranks "
        f"({_preset_default('batch_size')})",
    )
    p.add_argument(
        "--seq-len", type=int, help=f"tokens (bytes) per sequence ({_preset_default('seq_len')})"
    )
    p.add_argument("--lr", type=float, help=f"peak learning rate ({_preset_default('lr')})")
    p.add_argument("--warmup", type=int, help="linear warmup steps (default: 10%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument(
        "--optim",
        default="adamw",
        choices=OPTIMIZERS,
        help="torch's AdamW (fp32 states), or float8kit.optim's AdamW8bit / AdamW4bit "
        "(block-quantized states, docs/optim.md) (default adamw)",
    )
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument(
        "--float8-reduce-scatter",
        action="store_true",
        help="FSDP2 only: send the gradient reduce-scatter as blockwise e4m3 over one "
        "all-to-all, summed in fp32 on arrival (qgZ: one byte per gradient plus one fp32 "
        "scale per 128, instead of four bytes)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree (with sequence parallel; model.tp_plan); FSDP2 shards "
        "over the remaining WORLD_SIZE / TP ranks",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel degree (MoE presets): each group of EP consecutive ranks splits "
        "the experts (rank r keeps n_experts / EP of them) and sends each token to its "
        "experts' ranks, float8 rows with --float8; the dense parameters stay FSDP2-sharded "
        "over every rank, the experts over the WORLD_SIZE / EP ranks that hold the same ones",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto = cuda when available, else cpu",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU intra-op threads per process (0 = torch's default, one per core). "
        "1 by default: these models are too small to gain from more, and "
        "threads that wait on busy cores slow a step down many times",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the init and the batch sampler")
    p.add_argument("--out", help="output folder (default runs/PRESET_FLOAT8)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in --out (its metrics, config and checkpoints); "
        "without it such an --out is refused",
    )
    p.add_argument(
        "--filter-fqns",
        default="output,router",
        metavar="A,B",
        help="comma-separated module-name substrings kept in hp (torchtitan's "
        "filter_fqns); every other Linear goes through float8kit's default filter for the "
        "recipe (dims multiples of 16, of 128 for blockwise). Default: output,router",
    )
    p.add_argument(
        "--filter",
        choices=["default", "auto"],
        default="default",
        help="which Linears (after --filter-fqns) go float8: default = float8kit's default "
        "filter (aligned dims); auto = float8kit.auto_module_filter, only those the roofline "
        "model predicts faster in float8 on --filter-device at this run's tokens per step "
        "and data-parallel rank (docs/performance.md)",
    )
    p.add_argument(
        "--filter-device",
        default="h100",
        choices=["h100", "h200", "b200"],
        help="the GPU --filter auto predicts for (default h100)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="save a dcp checkpoint every N steps and at the end (0 = never)",
    )
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="continue from a checkpoint folder, or a run's --out (its latest "
        "complete one); its manifest must verify",
    )
    p.add_argument(
        "--data",
        metavar="PATH",
        help="a text file or folder to train on (default: the corpus shipped in "
        "recipes/corpus/, the same bytes on every machine)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=50,
        help="log val_loss every N steps and at the last step (0 = only the last)",
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        default=8,
        help="validation batches of --batch-size sequences per evaluation",
    )
    p.add_argument(
        "--log-every",
        type=int,
        default=10,
        help="when stderr is not a terminal: print a progress line every N steps "
        "(a terminal gets a progress bar)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar or progress lines")
    p.add_argument(
        "--monitor",
        "--monitor-every",  # under torchrun: its own parser takes --monitor for --monitor-interval
        dest="monitor",
        type=int,
        default=0,
        metavar="N",
        help="float8kit.Float8Monitor: every N steps, each float8 layer's SQNR against fp32, "
        "saturation and underflow, into OUT/monitor.jsonl (docs/monitor.md); 0 = off. "
        "FSDP2 then all-gathers weights in bf16 (the monitor needs the hp weight). Under "
        "torchrun spell it --monitor-every (torchrun reads --monitor as its --monitor-interval)",
    )
    p.add_argument(
        "--recompute-norms",
        action="store_true",
        help="recompute the RMSNorms in backward (float8kit.recompute_norms): less activation "
        "memory, bitwise the same gradients",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="print the activation bytes one forward of this model and batch keeps for "
        "backward, in bf16 and in the chosen float8 recipe (every recipe when none), with "
        "and without recomputed norms, and exit",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for k, v in PRESET_DEFAULTS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.warmup is None:
        args.warmup = max(1, args.steps // 10)
    if args.out is None:
        args.out = f"runs/{args.preset}_{args.float8}"
    for flag in ("steps", "batch_size", "seq_len", "eval_batches", "log_every", "tp", "ep"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.hp_forward_after and not args.float8.startswith("nvfp4"):
        p.error("--hp-forward-after is for the nvfp4 modes (the NVFP4 recipe's late switch)")
    for flag in (
        "warmup",
        "eval_every",
        "checkpoint_every",
        "threads",
        "monitor",
        "hp_forward_after",
    ):
        if getattr(args, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must be >= 0")
    if args.lr <= 0:
        p.error("--lr must be > 0")
    if args.monitor and args.tp > 1:
        p.error("--monitor does not support --tp > 1 (tensor-parallel weights are sharded)")
    if args.data is not None and not Path(args.data).exists():
        p.error(f"--data {args.data}: no such file or directory")
    return args
