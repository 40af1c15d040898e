"""Float8 tensor + sequence parallel on a SwiGLU MLP, a whole program:

    torchrun --nproc-per-node 2 recipes/tp_example.py

w1/w3 are split by output columns, w2 by input rows; the activations arrive sharded on the
sequence dim and are all-gathered as float8 (PrepareFloat8ModuleInput), the output is
reduce-scattered back to sequence shards. Runs on CPU (gloo) or GPUs (nccl).
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from float8kit import (
    Float8ColwiseParallel,
    Float8LinearConfig,
    Float8RowwiseParallel,
    PrepareFloat8ModuleInput,
    convert_to_float8_training,
)

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
device_type = "cuda" if torch.cuda.is_available() else "cpu"
if device_type == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
tp_mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("tp",))
torch.manual_seed(0)  # the same init on every rank


class MLP(nn.Module):
    def __init__(self, dim: int = 256, hidden: int = 512):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


mlp = MLP().to(device_type)
convert_to_float8_training(mlp, config=Float8LinearConfig())  # before parallelize_module
parallelize_module(
    mlp,
    tp_mesh,
    {
        "": PrepareFloat8ModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "w1": Float8ColwiseParallel(),
        "w3": Float8ColwiseParallel(),
        "w2": Float8RowwiseParallel(output_layouts=Shard(1)),
    },
)
optimizer = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
rank, shards = tp_mesh.get_local_rank(), tp_mesh.size()
for step in range(1, 6):
    x = torch.randn(4, 128, 256, device=device_type)  # (batch, sequence, dim), same on all ranks
    y = mlp(x.chunk(shards, dim=1)[rank])  # in and out: this rank's sequence shard
    loss = (y - 1).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f}")
dist.barrier()  # no rank tears gloo down while another is still in a collective
dist.destroy_process_group()
