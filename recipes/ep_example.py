"""MoE expert parallelism with float8 dispatch, a whole program:

    torchrun --nproc-per-node 2 recipes/ep_example.py

Each rank holds half of the 8 experts. A token is cast once, on its rank, as the experts'
first grouped gemm casts it, and crosses to its experts' rank as float8 rows with their
scales (one all-to-all); the outputs come back in hp. The same bits as one rank holding every
expert (docs/moe.md). Runs on CPU (gloo); rank 0 prints the mean loss over ranks.
"""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from float8kit import Float8ExpertsConfig, convert_experts_to_float8_training
from float8kit.distributed import expert_parallel as ep

dist.init_process_group("gloo")
rank, group = dist.get_rank(), dist.group.WORLD
torch.manual_seed(0)  # the same init on every rank


class MoE(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 128, n_experts: int = 8, top_k: int = 2):
        super().__init__()
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(n_experts, dim, hidden) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, hidden, dim) / hidden**0.5)
        self.n_experts, self.top_k = n_experts, top_k

    def forward(self, x):
        weights, experts = F.softmax(self.router(x), dim=-1).topk(self.top_k, dim=-1)
        order = experts.flatten().argsort(stable=True)  # rows sorted by expert
        token, row_expert = order // self.top_k, experts.flatten()[order]
        plan = ep.plan_dispatch(row_expert, self.n_experts, group)  # one host read
        config = self.w1._config  # the float8 experts' casts
        xs = ep.dispatch(x, token, plan, config)  # float8 rows of this rank's experts
        h = F.silu(torch._grouped_mm(xs, self.w1, offs=plan.offs))
        ys = ep.combine(torch._grouped_mm(h, self.w2, offs=plan.offs), plan, config)
        ys = ys * weights.flatten()[order, None]
        return x + torch.zeros_like(x).index_add_(0, token, ys)


model = MoE()
ep.shard_experts(model, ("w1", "w2"), group)  # keep this rank's 4 experts
config = Float8ExpertsConfig.from_recipe_name("rowwise")
# the weight gradient takes the float8 rows' values: all an expert's rank has of them
convert_experts_to_float8_training(
    model, config=dataclasses.replace(config, wgrad_operands="dequantized")
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
world = dist.get_world_size()

target = torch.randn(64, 64) / 8  # learn a fixed linear map
for step in range(1, 6):
    x = torch.randn(96, 64)  # each rank its own tokens
    loss = F.mse_loss(model(x), x @ target)
    loss.backward()
    for name, p in model.named_parameters():
        if name == "router.weight":  # replicated: average over the ranks
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        else:  # an expert's gradient already holds every rank's tokens
            p.grad /= world
    optimizer.step()
    optimizer.zero_grad()
    dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f}")
dist.barrier()  # no rank tears gloo down while another is still in a collective
dist.destroy_process_group()
