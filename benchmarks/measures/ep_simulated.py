"""Expert parallelism at 8..256 ranks, simulated in one process (no processes, no collectives).

For W virtual ranks this runs what ``float8kit.distributed.expert_parallel.dispatch`` runs on
each of them, through its pure per-rank steps: the rank sorts its (token, expert) rows
stably by expert (as recipes/model.py ``MoEFeedForward.routed`` does), counts rows per expert
(``expert_counts``), receives every rank's counts for its experts (the counts all-to-all,
simulated: rank r gets row r of every sender's (W, E_local) counts), plans (``make_plan``),
packs its rows (``pack_rows``), receives every sender's slice for it in rank order (the data
all-to-all, simulated from the senders' ``send_sizes``) and unpacks them (``unpack_rows``).

The reference is one rank holding every expert: the concatenated batch of all ranks, its
global stable sort by expert, every row cast with ``quantize_rows`` as the expert gemm casts
it, and the rows of rank r's experts sliced out. ``simulate`` returns both, per rank, plus
the routing table and the bytes each rank's dispatch sends.

``torchao_received`` builds the same rank's received rows the way torchao 0.18's MXFP8
expert-parallel pipeline (``torchao.prototype.moe_training.ep``) would, from the parts of it
that run on a CPU: its pure-torch ``to_mx`` standing in for the Triton
``triton_to_mxfp8_dim0`` that ``a2a_dispatch_mxfp8_fwd_hp_bwd`` calls, and its
``permute_mxfp8_fwd_hp_bwd`` with ``generate_permute_indices(use_cpu=True)`` in place of the
Triton index kernel.

    python -m benchmarks.measures.ep_simulated    # the routing and bytes table
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings

import torch

from benchmarks.measures.expert_parallel import MXFP8, ROWWISE
from float8kit import Float8ExpertsConfig
from float8kit.distributed import expert_parallel as ep
from float8kit.experts import Float8ExpertWeight, float8_grouped_mm
from float8kit.quantized_rows import quantize_rows
from float8kit.tensor import Float8TrainingTensor

CONFIGS = {"rowwise": ROWWISE, "mxfp8": MXFP8}


@dataclasses.dataclass(frozen=True)
class Case:
    """One MoE layer's routing over ``world`` ranks: ``tokens[r]`` tokens on rank r, each to
    ``top_k`` distinct experts of ``world * e_local``."""

    name: str
    world: int
    e_local: int
    dim: int
    top_k: int
    tokens: tuple[int, ...]
    routing: str  # "uniform" or "skewed"
    seed: int = 0

    @property
    def n_experts(self) -> int:
        return self.world * self.e_local


def _uneven(world: int, most: int, zero_every: int) -> tuple[int, ...]:
    """Uneven token counts, 0 on every ``zero_every``-th rank (rank 0 included)."""
    return tuple(0 if r % zero_every == 0 else (r * 37) % most + 1 for r in range(world))


CASES = [
    Case("ep8_uniform_top2", 8, 2, 64, 2, (0, 37, 5, 100, 0, 64, 13, 91), "uniform"),
    Case("ep8_skewed_top4_dim128", 8, 1, 128, 4, (40, 0, 33, 70, 1, 0, 52, 19), "skewed"),
    Case("ep16_skewed_top1", 16, 2, 64, 1, _uneven(16, 60, 5), "skewed"),
    Case("ep64_uniform_top2", 64, 2, 64, 2, _uneven(64, 50, 7), "uniform"),
    Case("ep64_skewed_top4_dim128", 64, 1, 128, 4, _uneven(64, 30, 9), "skewed"),
    Case("ep256_skewed_top1", 256, 1, 64, 1, _uneven(256, 9, 11), "skewed"),
    Case("ep256_uniform_top4", 256, 1, 64, 4, _uneven(256, 5, 13), "uniform"),
]


def expert_weights(case: Case) -> torch.Tensor:
    """Routing preference per expert. "skewed": the experts of every 4th rank (rank 3, 7,
    ...) and expert 1 get nothing, expert 0 ~20x a typical expert, the rest decaying."""
    e = case.n_experts
    if case.routing == "uniform":
        return torch.ones(e)
    w = torch.logspace(0, -1, e)
    w[0] = 20.0
    w[1] = 0.0
    cold_rank = (torch.arange(e) // case.e_local) % 4 == 3
    w[cold_rank] = 0.0
    return w


def routing(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's (x (T, dim) bf16, experts (T, top_k) distinct per token): a seeded
    weighted draw without replacement (``rand ** (1 / w)``, top-k); rows of different
    magnitudes; one all-zero token (on the first rank with two tokens or more)."""
    g = torch.Generator().manual_seed(case.seed * 1000 + case.world)
    w = expert_weights(case)
    out, zeroed = [], False
    for t in case.tokens:
        keys = torch.rand(t, case.n_experts, generator=g) ** (1 / w.clamp_min(1e-30))
        keys[:, w == 0] = -1.0
        experts = keys.topk(case.top_k, dim=-1).indices
        mag = 10.0 ** (torch.rand(t, 1, generator=g) * 6 - 3)
        x = (torch.randn(t, case.dim, generator=g) * mag).to(torch.bfloat16)
        if t >= 2 and not zeroed:
            x[1], zeroed = 0, True
        out.append((x, experts))
    return out


def sort_rows(experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, row_expert) of the rows sorted stably by expert: ``MoEFeedForward.routed``."""
    order = experts.flatten().argsort(stable=True)
    return order // experts.size(1), experts.flatten()[order]


@dataclasses.dataclass
class Rank:
    """What one simulated rank sent and received, and one rank's rows for its experts."""

    plan: ep.EPPlan
    sent_bytes: int  # the packed dispatch buffer
    rows_sent: int
    received: Float8TrainingTensor  # the dispatched rows
    ref_data: torch.Tensor  # one rank's cast of these experts' rows (uint8 view)
    ref_scale: torch.Tensor
    ref_offs: torch.Tensor  # one rank's group ends for these experts, from 0


@dataclasses.dataclass
class World:
    case: Case
    recipe: str
    ranks: list[Rank]
    expert_rows: torch.Tensor  # rows per expert over the whole batch


def simulate(case: Case, recipe: str, ep_config: ep.EPConfig | None = None) -> World:
    ep_config = ep_config or ep.EPConfig()
    config, e, el, w = CONFIGS[recipe], case.n_experts, case.e_local, case.world
    data = routing(case)
    sorted_ = [sort_rows(experts) for _, experts in data]
    counts = [ep.expert_counts(row_expert, e) for _, row_expert in sorted_]
    # the counts all-to-all: rank r receives every sender's counts for its experts
    table = torch.stack(counts).view(w, w, el)  # (src, dst, local expert)
    plans = [ep.make_plan(counts[r], table[:, r], None, e) for r in range(w)]
    packed = [
        ep.pack_rows(x, token, config, ep_config)
        for (x, _), (token, _) in zip(data, sorted_, strict=True)
    ]
    # the data all-to-all: each sender's buffer split by its send sizes, in rank order
    pieces = [p.split(plan.send_sizes) for p, plan in zip(packed, plans, strict=True)]
    received = []
    for r, plan in enumerate(plans):
        got = [pieces[src][r] for src in range(w)]
        assert [len(g) for g in got] == plan.recv_sizes
        buf = torch.cat(got)
        received.append(ep.unpack_rows(buf, plan, case.dim, config, ep_config, torch.bfloat16))
    # one rank: the whole batch, its global stable sort, every row cast as the gemm casts it
    ref_data, ref_scale, ends = one_rank_rows(case, config, data)
    ranks = []
    for r in range(w):
        lo = 0 if r == 0 else int(ends[r * el - 1])
        hi = int(ends[(r + 1) * el - 1])
        ranks.append(
            Rank(
                plans[r],
                packed[r].numel() * packed[r].element_size(),
                len(packed[r]),
                received[r],
                ref_data[lo:hi],
                ref_scale[lo:hi],
                (ends[r * el : (r + 1) * el] - lo).to(torch.int32),
            )
        )
    return World(case, recipe, ranks, torch.stack(counts).sum(0))


def one_rank_rows(case: Case, config: Float8ExpertsConfig, data):
    """(uint8 data, scales, group ends) of every row of the concatenated batch, sorted and
    cast as one rank holding every expert would."""
    x = torch.cat([x for x, _ in data])
    experts = torch.cat([experts for _, experts in data])
    token, row_expert = sort_rows(experts)
    d, s = quantize_rows(x[token], config)
    ends = ep.expert_counts(row_expert, case.n_experts).cumsum(0)
    return d.view(torch.uint8), s, ends


def expert_gemm_rows(world: World, n: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per rank: (its experts' grouped gemm forward on the rows it received, the one-rank
    grouped gemm's output rows for those experts), with seeded (E, dim, n) weights."""
    case, config = world.case, CONFIGS[world.recipe]
    g = torch.Generator().manual_seed(7)
    w_all = (torch.randn(case.n_experts, case.dim, n, generator=g) * case.dim**-0.5).to(
        torch.bfloat16
    )
    data = routing(case)
    x = torch.cat([x for x, _ in data])
    token, row_expert = sort_rows(torch.cat([experts for _, experts in data]))
    ends = ep.expert_counts(row_expert, case.n_experts).cumsum(0)
    with torch.no_grad():
        ref = float8_grouped_mm(x[token], Float8ExpertWeight(w_all, config), ends.to(torch.int32))
    out, el = [], case.e_local
    for r, rank in enumerate(world.ranks):
        w_local = Float8ExpertWeight(w_all[r * el : (r + 1) * el].clone(), config)
        with torch.no_grad():
            mine = float8_grouped_mm(rank.received, w_local, rank.plan.offs)
        lo = 0 if r == 0 else int(ends[r * el - 1])
        out.append((mine, ref[lo : lo + len(mine)]))
    return out


def summary(world: World) -> dict:
    """The routing table and the bytes per rank, as the report prints them."""
    case, ranks = world.case, world.ranks
    received = [rk.plan.num_received for rk in ranks]
    with_rows = [rk for rk in ranks if rk.rows_sent]
    ratios = sorted({rk.sent_bytes / (rk.rows_sent * 2 * case.dim) for rk in with_rows})
    return {
        "case": case.name,
        "recipe": world.recipe,
        "world": case.world,
        "experts": case.n_experts,
        "dim": case.dim,
        "top_k": case.top_k,
        "tokens": sum(case.tokens),
        "ranks_without_tokens": sum(t == 0 for t in case.tokens),
        "experts_without_rows": int((world.expert_rows == 0).sum()),
        "rows_received_max": max(received),
        "rows_received_min": min(received),
        "ranks_receiving_none": sum(n == 0 for n in received),
        "dispatch_bytes_max": max(rk.sent_bytes for rk in ranks),
        "dispatch_bytes_total": sum(rk.sent_bytes for rk in ranks),
        "bf16_bytes_total": sum(rk.rows_sent * 2 * case.dim for rk in ranks),
        "ratio_per_rank": ratios,  # one value: the same for every rank with rows
    }


# ---------------------------------------------------------------------------- torchao 0.18


def _torchao():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.moe_training.ep import kernels, permute
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor, to_mx
    return kernels, permute, ScaleCalculationMode, MXTensor, to_mx


def torchao_sent(x: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What torchao's ``a2a_dispatch_mxfp8_fwd_hp_bwd`` sends for a rank's sorted rows
    ``x[token]``: e4m3 data (R, K) and e8m0 scales (R, K / 32) as uint8, two all-to-alls.
    Its quantizer (``triton_to_mxfp8_dim0``, Triton only) replaced by torchao's own
    pure-torch ``to_mx`` along K with RCEIL, the mode it defaults to."""
    _, _, mode, _, to_mx = _torchao()
    rows = x[token]
    scale, data = to_mx(rows, torch.float8_e4m3fn, 32, mode.RCEIL)
    return data, scale.view(torch.uint8).reshape(len(rows), x.size(1) // 32)


def torchao_received(case: Case, data=None):
    """Per rank, torchao's received and permuted MXTensor's (data uint8, scales uint8) and
    its ``num_tokens_per_expert_padded`` group ends: the rows of ``torchao_sent`` from every
    rank, exchanged as ``a2a_dispatch`` splits them, then ``permute_mxfp8_fwd_hp_bwd``
    (expert-major, every group zero-padded to a multiple of 32 rows, an empty expert to 32)
    with its index kernel on the CPU (``generate_permute_indices(..., use_cpu=True)``)."""
    kernels, permute, _, mx_tensor, _ = _torchao()
    w, el, e = case.world, case.e_local, case.n_experts
    data = data or routing(case)
    sorted_ = [sort_rows(experts) for _, experts in data]
    counts = torch.stack([ep.expert_counts(re, e) for _, re in sorted_])  # (src, E)
    sent = [torchao_sent(x, token) for (x, _), (token, _) in zip(data, sorted_, strict=True)]
    splits = counts.view(w, w, el).sum(2)  # (src, dst) rows
    pieces = [
        (d.split(s.tolist()), sc.split(s.tolist())) for (d, sc), s in zip(sent, splits, strict=True)
    ]
    real = permute.generate_permute_indices

    def on_cpu(*args, **kwargs):
        return real(*args, **kwargs, use_cpu=True)

    out = []
    permute.generate_permute_indices = on_cpu
    try:
        for r in range(w):
            d = torch.cat([pieces[src][0][r] for src in range(w)])
            sc = torch.cat([pieces[src][1][r] for src in range(w)])
            mx = mx_tensor(
                d,
                sc.view(torch.float8_e8m0fnu),
                elem_dtype=torch.float8_e4m3fn,
                block_size=32,
                orig_dtype=torch.bfloat16,
                kernel_preference=None,
                act_quant_kwargs=None,
                is_swizzled_scales=False,
            )
            tokens_per_expert_group = counts[:, r * el : (r + 1) * el].flatten()
            _, got, _, _, group_ends = permute.permute_mxfp8_fwd_hp_bwd(
                mx, tokens_per_expert_group, w, el, 32
            )
            out.append((got.qdata.view(torch.uint8), got.scale.view(torch.uint8), group_ends))
    finally:
        permute.generate_permute_indices = real
    return out


# ---------------------------------------------------------------------------- report


def main() -> None:
    import datetime
    import platform

    rows = [summary(simulate(c, recipe)) for c in CASES for recipe in CONFIGS]
    cols = ["case", "recipe", "world", "experts", "top_k", "tokens", "ranks_without_tokens"]
    cols += ["experts_without_rows", "rows_received_max", "rows_received_min"]
    cols += ["ranks_receiving_none", "ratio_per_rank"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    meta = {
        "device": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
