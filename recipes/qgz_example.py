"""FSDP2 with the float8 gradient reduce-scatter (qgZ), a whole program:

    torchrun --nproc-per-node 2 recipes/qgz_example.py

The float8 weights are all-gathered as float8, and every FSDP2 module's gradient
reduce-scatter is sent as blockwise-scaled e4m3 over one all-to-all and summed in fp32 on
arrival. Runs on CPU (gloo) or GPUs (nccl); rank 0 prints the mean loss over ranks.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from float8kit import (
    Float8LinearConfig,
    convert_to_float8_training,
    enable_float8_reduce_scatter,
    precompute_scales,
)

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)  # the same init on every rank


class Block(nn.Module):
    def __init__(self, dim: int = 256, hidden: int = 512):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


model = nn.Sequential(*[Block() for _ in range(2)]).to(device)
config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
convert_to_float8_training(model, config=config)  # before fully_shard
for block in model:
    fully_shard(block)
fully_shard(model)
enable_float8_reduce_scatter(model)  # once, on the root, after fully_shard
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

target = torch.randn(256, 256, device=device) / 16  # learn a fixed linear map
for step in range(1, 6):
    x = torch.randn(64, 256, device=device)  # each rank its own batch
    loss = nn.functional.mse_loss(model(x), x @ target)
    loss.backward()  # the gradients are reduce-scattered in float8
    optimizer.step()
    optimizer.zero_grad()
    precompute_scales(model)
    dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f}")
dist.barrier()  # no rank tears gloo down while another is still in a collective
dist.destroy_process_group()
