"""Quickstart: the same small MLP trained in high precision and in float8, side by side, on CPU.

    python recipes/quickstart.py            # well under a minute on 2 cores
    python recipes/quickstart.py --steps 300 --recipe rowwise

A teacher network makes the targets, so the task is learnable and both runs see the same
data; the loss columns should track each other closely. The hp dtype is the one this CPU
runs well (float8kit.versions.cpu_hp_dtype: bf16 where the CPU has native bf16, fp32
otherwise, where emulated bf16 is many times slower; FLOAT8KIT_CPU_HP_DTYPE overrides).
"""

import argparse

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--steps", type=int, default=100, help="training steps per run")
parser.add_argument(
    "--dim", type=int, default=128, help="model width (multiple of 16; of 32 for mxfp8, nvfp4)"
)
parser.add_argument("--batch-size", type=int, default=256, help="rows per batch")
parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate")
parser.add_argument(
    "--recipe",
    default="tensorwise",
    choices=[
        "tensorwise",
        "rowwise",
        "rowwise_with_gw_hp",
        "delayed",
        "blockwise",
        "mxfp8",
        "nvfp4",
    ],
    help="float8 recipe (Float8LinearConfig.from_recipe_name)",
)
parser.add_argument("--seed", type=int, default=0, help="seed for model and data")
parser.add_argument(
    "--threads",
    type=int,
    default=1,
    help="CPU threads (0 = torch's default, one per core); 1 by default, as train.py: this "
    "model is too small to gain from more, and threads waiting on busy cores slow it many times",
)
args = parser.parse_args()  # before torch is imported: --help and bad flags answer at once
for name in ("steps", "dim", "batch_size"):
    if getattr(args, name) < 1:
        parser.error(f"--{name.replace('_', '-')} must be >= 1")
if args.threads < 0:
    parser.error("--threads must be >= 0")
if args.dim % 16:
    parser.error(f"--dim {args.dim} must be a multiple of 16 (float8 gemms need it)")
if args.recipe in ("mxfp8", "nvfp4") and args.dim % 32:
    parser.error(f"--dim {args.dim} must be a multiple of 32 for {args.recipe}")

import copy  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from float8kit import (  # noqa: E402
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_scales,
)
from float8kit.versions import cpu_hp_dtype  # noqa: E402

if args.threads:
    torch.set_num_threads(args.threads)
HP = cpu_hp_dtype()
hp_name = str(HP).removeprefix("torch.")

# ---------------------------------------------------------------------------- model and data
torch.manual_seed(args.seed)


def mlp(dim: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.GELU(), nn.Linear(dim, dim)
    )


teacher = mlp(args.dim)
hp_model = mlp(args.dim).to(HP)
fp8_model = copy.deepcopy(hp_model)
convert_to_float8_training(  # float8
    fp8_model,
    config=Float8LinearConfig.from_recipe_name(args.recipe),  # float8
)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    x = torch.randn(args.batch_size, args.dim, generator=g)
    with torch.no_grad():
        y = teacher(x)
    return x.to(HP), y.to(HP)


# ---------------------------------------------------------------------------- training
def train(model: nn.Module) -> tuple[list[float], float]:
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x).float(), y.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        precompute_scales(model)  # float8: folds DELAYED amaxes in; a no-op for the others
        losses.append(loss.item())
    return losses, time.perf_counter() - start


print(fp8_model)
print(f"hp dtype: {hp_name} (float8kit.versions.cpu_hp_dtype)")
hp_losses, hp_s = train(hp_model)
fp8_losses, fp8_s = train(fp8_model)

hp_col = f"hp ({hp_name}) loss"
print(f"\n{'step':>6} {hp_col:>20} {'float8 loss':>12}")
for step in list(range(0, args.steps, max(1, args.steps // 10))) + [args.steps - 1]:
    print(f"{step:>6} {hp_losses[step]:>20.5f} {fp8_losses[step]:>12.5f}")
gap = 100 * (fp8_losses[-1] - hp_losses[-1]) / hp_losses[-1]
print(
    f"\nfinal loss gap float8 vs hp ({hp_name}): {gap:+.2f}%  "
    f"(hp {hp_s:.1f} s, float8 {fp8_s:.1f} s, one after the other)"
)
