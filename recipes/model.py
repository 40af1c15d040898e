"""A compact Llama-style decoder: RMSNorm, RoPE, GQA attention (SDPA), SwiGLU.

Every projection is a plain ``nn.Linear`` so a float8 converter can swap it; the lm head is
``output`` (recipes keep it in hp) and the blocks live in ``model.layers`` (FSDP wraps each).
With ``n_experts > 0`` the FFN is a top-k routed mixture of SwiGLU experts (``MoEFeedForward``):
3-D expert weights (experts, in, out) run through ``torch._grouped_mm`` on tokens sorted by
expert, and a load-balancing loss joins the training loss. Vocabulary is 256: the recipes
train on raw bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 176  # SwiGLU hidden size; a multiple of 16 so float8 can convert w1/w2/w3
    vocab_size: int = 256  # bytes
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048  # RoPE table length; a longer --seq-len grows it
    n_experts: int = 0  # > 0: the FFN is a mixture of n_experts routed SwiGLU experts
    top_k: int = 2  # experts per token
    moe_hidden: int = 64  # each expert's SwiGLU hidden size (a multiple of 16 for float8)
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss in the training loss

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..n_experts={self.n_experts}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_name(cls, name: str, **overrides) -> ModelArgs:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


# Linear shapes of tiny/small are all multiples of 16 (what torch._scaled_mm needs), so
# float8 converts every projection; only the lm head is kept in hp by the recipe's filter.
PRESETS: dict[str, dict] = {
    # CPU smoke test and unit tests: ~0.1 M params.
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=176),
    # The CPU demo that compare.py runs: ~0.8 M params.
    "small": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=352),
    # CPU MoE smoke test: tiny with 8 routed experts (top-2) in place of the dense FFN.
    "moe-tiny": dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=8, top_k=2, moe_hidden=64
    ),
    # GPU: ~1.2 B params (Llama-3.2-1B-like widths, 256-byte vocab).
    "1b": dict(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=8192,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    # GPU benchmark: Llama-3-8B layer shapes, 4 layers.
    "llama3-8b-4l": dict(
        dim=4096,
        n_layers=4,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32: under bf16 autocast the mean of squares loses too many bits.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).type_as(x)


def rope_table(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, hd); rotate interleaved pairs (x0, x1) by the position's angle, in fp32.
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # GQA: each kv head serves n_heads // n_kv_heads query heads.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts. Each token goes to its ``top_k`` highest-scoring experts
    (router softmax, weights renormalized over the chosen k); the (token, expert) pairs are
    sorted by expert so that each expert's tokens are one contiguous group, and the three
    expert gemms are ``torch._grouped_mm`` over those jagged groups (``offs``: cumulative
    group ends; an expert may get no tokens). ``aux_loss`` is the Switch Transformer
    load-balancing loss of the last forward: n_experts * sum_e f_e * p_e (f_e: the share of
    assignments expert e got, p_e: its mean router probability); 1.0 when balanced."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.top_k
        e, d, h = args.n_experts, args.dim, args.moe_hidden
        self.router = nn.Linear(d, e, bias=False)
        self.w1 = nn.Parameter(torch.empty(e, d, h))  # gate (experts, in, out)
        self.w3 = nn.Parameter(torch.empty(e, d, h))  # up
        self.w2 = nn.Parameter(torch.empty(e, h, d))  # down
        self.aux_loss = torch.zeros(())
        self.n_experts = e
        self.ep = None  # (process group, EPConfig) once shard_experts ran

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x).float(), dim=-1)  # (tokens, experts)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out, counts = self.routed(x, weights, experts)
        share = counts.float() / experts.numel()
        self.aux_loss = self.n_experts * (share * probs.mean(0)).sum()
        return out.view(shape)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor):
        """The experts' weighted sum for tokens ``x`` (T, dim) routed to ``experts`` (T, k)
        with ``weights`` (T, k); also the assignments per expert (all experts, this rank's
        tokens). With ``self.ep`` set (``shard_experts``), this rank holds only its experts
        and the tokens cross the expert-parallel group (float8kit.distributed.expert_parallel)."""
        # Sort the (token, expert) pairs by expert: each expert's tokens become one group.
        order = experts.flatten().argsort(stable=True)
        token = order // experts.size(1)
        row_expert = experts.flatten()[order]
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, row_expert, torch.ones_like(row_expert))  # no host sync
        dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type):  # grouped_mm has no autocast rule
            dtype = torch.get_autocast_dtype(x.device.type)
        if self.ep is None:
            offs = counts.cumsum(0).to(torch.int32)
            ys = self.expert_gemms(x[token].to(dtype), offs)
        else:
            from float8kit.distributed import expert_parallel as ep

            group, ep_config = self.ep
            config = getattr(self.w1, "_config", None)  # None: hp experts
            plan = ep.plan_dispatch(row_expert, self.n_experts, group)
            xs = ep.dispatch(x.to(dtype), token, plan, config, ep_config)
            ys = ep.combine(self.expert_gemms(xs, plan.offs), plan, config, ep_config)
        ys = ys * weights.flatten()[order, None].to(dtype)
        return torch.zeros_like(x).index_add_(0, token, ys.to(x.dtype)), counts

    def expert_gemms(self, xs: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """SwiGLU over rows ``xs`` sorted by (this rank's) expert, groups ending at ``offs``."""
        w1, w2, w3 = (w.to(xs.dtype) for w in (self.w1, self.w2, self.w3))
        h = F.silu(torch._grouped_mm(xs, w1, offs=offs)) * torch._grouped_mm(xs, w3, offs=offs)
        return torch._grouped_mm(h, w2, offs=offs)

    def shard_experts(self, group, ep_config=None) -> None:
        """Keep only this rank's experts (rank r of ``group``: experts [r * E / ep, (r + 1) *
        E / ep)) and route tokens across ``group``. Call before converting the experts."""
        from float8kit.distributed import expert_parallel as ep

        ep.shard_experts(self, ("w1", "w2", "w3"), group)
        self.ep = (group, ep_config or ep.EPConfig())


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = MoEFeedForward(args) if args.n_experts else FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_table(args.head_dim, args.max_seq_len, args.rope_theta)
        # Non-persistent: derived from args, so checkpoints hold only trained state.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        # GPT-2 style: N(0, 0.02), residual projections shrunk by depth so the residual
        # stream's variance does not grow with n_layers.
        for name, p in self.named_parameters():
            if name.endswith(("wo.weight", "w2.weight", "feed_forward.w2")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.args.n_layers))
            elif p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Returns logits (B, T, vocab), or the mean cross-entropy when targets are given."""
        T = idx.shape[1]
        if T > self.rope_cos.shape[0]:
            raise ValueError(f"sequence length {T} > max_seq_len {self.rope_cos.shape[0]}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        h = self.tok_embeddings(idx)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        if self.args.n_experts:
            aux = sum(layer.feed_forward.aux_loss for layer in self.layers)
            loss = loss + self.args.aux_loss_coef * aux
        return loss


def tp_plan(model: Transformer, float8: bool) -> dict:
    """A ``parallelize_module`` plan: tensor parallel with sequence parallel (Megatron-style,
    as torchtitan's Llama): projections colwise/rowwise, norms and the residual stream sharded
    on the sequence dim, activations all-gathered before each attention and feed-forward.
    ``float8``: float8kit's styles for the (converted) blocks, whose sequence-parallel
    all-gathers then move float8 bytes; the embedding and the hp lm head keep torch's."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if float8:
        import float8kit

        colwise, rowwise = float8kit.Float8ColwiseParallel, float8kit.Float8RowwiseParallel
        prepare = float8kit.PrepareFloat8ModuleInput
    else:
        colwise, rowwise, prepare = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    plan = {
        "tok_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        plan |= {
            p + "attention_norm": SequenceParallel(),
            p + "attention": prepare(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
            ),
            p + "attention.wq": colwise(),
            p + "attention.wk": colwise(),
            p + "attention.wv": colwise(),
            p + "attention.wo": rowwise(output_layouts=Shard(1), use_local_output=False),
            p + "ffn_norm": SequenceParallel(),
            p + "feed_forward": prepare(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            p + "feed_forward.w1": colwise(),
            p + "feed_forward.w3": colwise(),
            p + "feed_forward.w2": rowwise(output_layouts=Shard(1), use_local_output=False),
        }
    return plan
