"""Expert parallelism: MoE tokens cross ranks already cast for the expert's grouped gemm.

Each rank of an expert-parallel group holds ``n_experts / ep`` consecutive experts (rank r:
experts ``[r * E_local, (r + 1) * E_local)``). A MoE layer's tokens take three steps:

1. the model routes its local tokens and sorts the (token, expert) rows stably by expert
   (``order = experts.flatten().argsort(stable=True)``, ``token = order // top_k``): the
   rows are then grouped by destination rank too;
2. ``dispatch`` casts the local tokens once, in exactly the form the experts' first grouped
   gemm consumes (rowwise e4m3 + one scale per row, or e4m3 + one e8m0 byte per 32 along K
   for MXFP8), gathers the float8 rows, packs data and scales into one uint8 buffer and sends
   it with one ``all_to_all_single``; the receiver reorders the rows from rank-major to
   expert-major (device indices, no host sync) and hands the gemm float8 rows
   (``dispatched_rows``) it does not cast again;
3. the experts run their grouped gemms on the rows; ``combine`` sends the outputs back in hp
   and returns them in the rows' local sorted order: the model weights and sums them as it
   would without expert parallelism.

Backward: the combine's backward casts the output gradient rows on the rank that owns the
tokens and sends float8 (the gemm's grad_input cast, along N); the dispatch's backward sends
hp input gradients. ``EPConfig(comm="hp")`` sends everything in hp (the bf16 baseline).

**Exact.** A per-row cast commutes with permuting rows, and the rows of each expert arrive
in the order one rank would hold them (ranks in order, each rank's rows in its stable sort:
the stable sort of the concatenated batch). So an expert-parallel step computes the same
bits as the same MoE with every expert on one rank, for the same tokens: outputs, input
gradients and expert weight gradients, provided the weight-gradient gemm casts the
dequantized rows on both (``Float8ExpertsConfig.wgrad_operands="dequantized"``; an expert
rank has no hp values of the tokens it received).

**Host syncs.** One per dispatch: the all-to-all's split sizes (a ``.tolist()`` of the
rank's send and receive counts, exchanged on the device first). The backward and the combine
reuse them.

**Bytes per (token, expert) row** with K the model dim and N the expert output dim (= K):
bf16 dispatch 2K, float8 K + s (s = 1 e8m0 byte per row for power-of-two rowwise scales, 4
for fp32 scales, K/32 for MX); combine 2N both ways in hp; combine backward N + s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from float8kit.config import E4M3, Float8ExpertsConfig, GemmRole
from float8kit.experts import made_by_expert_gemm
from float8kit.quantized_rows import dispatched_rows, quantize_rows, rows_format
from float8kit.tensor import Float8TrainingTensor, wrap_local

COMMS = ("float8", "hp")
SCALE_FORMATS = ("auto", "e8m0", "fp32")


@dataclasses.dataclass(frozen=True)
class EPConfig:
    """How tokens cross the expert-parallel group.

    ``comm``: "float8" (default) dispatches float8 rows in the experts' gemm form and sends
    the combine's backward in float8; "hp" sends every exchange in the activations' dtype.
    ``scale_format``: how a rowwise scale travels: "e8m0" one byte (its exponent: exact for
    the power-of-two scales the rowwise recipes use; a row whose scale is not a power of two,
    an amax within 12% of fp32's max, arrives as NaN: visible, never wrong), "fp32" four
    bytes (always exact), "auto" (default) e8m0 when the experts round their scales to powers
    of two. MX scales are e8m0 bytes already.
    """

    comm: str = "float8"
    scale_format: str = "auto"

    def __post_init__(self):
        if self.comm not in COMMS:
            raise ValueError(f"EPConfig.comm={self.comm!r}: use one of {COMMS}")
        if self.scale_format not in SCALE_FORMATS:
            raise ValueError(
                f"EPConfig.scale_format={self.scale_format!r}: use one of {SCALE_FORMATS}"
            )


@dataclasses.dataclass
class EPPlan:
    """One MoE layer's routing across the group, for one forward (and its backward).

    ``send_sizes[r]`` rows go to rank r (this rank's rows for r's experts, in sorted order);
    ``recv_sizes[r]`` come from rank r. ``recv_order`` takes the received (rank-major) rows
    to expert-major order; ``offs`` are the local experts' cumulative group ends (int32), the
    ``offs`` of their grouped gemms."""

    group: dist.ProcessGroup
    n_experts: int
    send_sizes: list[int]
    recv_sizes: list[int]
    recv_order: torch.Tensor
    offs: torch.Tensor

    @property
    def num_rows(self) -> int:
        """Rows this rank sends (its tokens times top-k)."""
        return sum(self.send_sizes)

    @property
    def num_received(self) -> int:
        return sum(self.recv_sizes)


def expert_counts(row_expert: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Rows per expert (int64, all ``n_experts``), on the device: no host sync."""
    counts = torch.zeros(n_experts, dtype=torch.int64, device=row_expert.device)
    return counts.scatter_add_(0, row_expert.long(), torch.ones_like(row_expert, dtype=torch.int64))


def make_plan(
    counts: torch.Tensor,
    recv: torch.Tensor,
    group,
    n_experts: int,
    row_expert: torch.Tensor | None = None,
) -> EPPlan:
    """The plan from this rank's ``counts`` per expert and ``recv`` (ep, E_local): the rows
    each rank sends each of this rank's experts (what the counts all-to-all delivers). Reads
    the split sizes to the host: the one sync of a dispatch, which also checks that
    ``row_expert`` (when given) is sorted: unsorted rows would run through other experts'
    weights without an error."""
    ep, local = recv.shape
    checks = [counts.view(ep, local).sum(1), recv.sum(1)]
    if row_expert is not None:  # how many rows come after a row of a higher expert
        checks.append((row_expert[1:] < row_expert[:-1]).sum().reshape(1).to(counts.dtype))
    sizes = torch.cat(checks).tolist()
    if row_expert is not None and sizes[-1]:
        raise ValueError(
            f"float8kit: plan_dispatch needs the rows sorted by expert (row_expert "
            f"non-decreasing); {sizes[-1]} of {row_expert.numel()} rows follow a row of a "
            "higher expert. Sort the (token, expert) rows stably by expert first: order = "
            "experts.flatten().argsort(stable=True), row_expert = experts.flatten()[order], "
            "token = order // top_k (docs/moe.md)"
        )
    send_sizes, recv_sizes = sizes[:ep], sizes[ep : 2 * ep]
    # rank-major -> expert-major: segment (src, e) starts at start[src, e] in the buffer
    flat = recv.flatten()
    start = (flat.cumsum(0) - flat).view(ep, local)
    lengths, starts = recv.t().flatten(), start.t().flatten()
    total = sum(recv_sizes)
    out_start = lengths.cumsum(0) - lengths
    recv_order = torch.repeat_interleave(starts - out_start, lengths, output_size=total)
    recv_order += torch.arange(total, device=recv_order.device)
    offs = recv.sum(0).cumsum(0).to(torch.int32)
    return EPPlan(group, n_experts, send_sizes, recv_sizes, recv_order, offs)


def plan_dispatch(
    row_expert: torch.Tensor, n_experts: int, group: dist.ProcessGroup | None = None
) -> EPPlan:
    """The plan for rows routed to ``row_expert`` (non-decreasing: the rows sorted by
    expert; unsorted rows raise). Exchanges the per-expert counts (one small all-to-all) and
    reads the split sizes to the host (the one sync of a dispatch)."""
    group = group or dist.group.WORLD
    ep = dist.get_world_size(group)
    if n_experts % ep:
        raise ValueError(
            f"float8kit: {n_experts} experts cannot be split evenly over an expert-parallel "
            f"group of {ep} ranks"
        )
    counts = expert_counts(row_expert, n_experts)
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    return make_plan(counts, recv.view(ep, n_experts // ep), group, n_experts, row_expert)


# ---------------------------------------------------------------------------- the wire


def _exchange(send: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group):
    """One ``all_to_all_single`` of 2-D ``send`` (rows split by ``in_sizes``), returning the
    rows received (split by ``out_sizes``)."""
    out = send.new_empty((sum(out_sizes), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), out_sizes, in_sizes, group=group)
    return out


def _scale_format(config: Float8ExpertsConfig, ep: EPConfig) -> str:
    if ep.scale_format != "auto":
        return ep.scale_format
    return "e8m0" if config.round_scales_to_power_of_2 else "fp32"


def _to_experts(rows: torch.Tensor, plan: EPPlan) -> torch.Tensor:
    """This rank's sorted rows to the ranks of their experts, received expert-major."""
    rows = _exchange(rows, plan.recv_sizes, plan.send_sizes, plan.group)
    return rows.index_select(0, plan.recv_order)


def _to_owners(rows: torch.Tensor, plan: EPPlan) -> torch.Tensor:
    """Expert-major rows back (rank-major) to the ranks that own their tokens."""
    rank_major = torch.empty_like(rows).index_copy_(0, plan.recv_order, rows)
    return _exchange(rank_major, plan.send_sizes, plan.recv_sizes, plan.group)


def pack_rows(
    hp: torch.Tensor, token: torch.Tensor | None, config: Float8ExpertsConfig, ep: EPConfig
) -> torch.Tensor:
    """What this rank sends: ``hp`` (T, K) cast once per row as the experts' gemm casts it,
    data and scale bytes side by side (uint8 (R, K + s)), rows ``token`` (or all, for
    ``token`` None) in this rank's sorted order."""
    data, scale = quantize_rows(hp, config)
    scale_bytes = rows_format(config).scale_bytes(scale, _scale_format(config, ep))
    packed = torch.cat([data.view(torch.uint8), scale_bytes], dim=1)
    return packed if token is None else packed.index_select(0, token)


def unpack_rows(
    received: torch.Tensor,
    plan: EPPlan,
    k: int,
    config: Float8ExpertsConfig,
    ep: EPConfig,
    hp_dtype: torch.dtype,
    role: GemmRole = GemmRole.INPUT,
) -> Float8TrainingTensor:
    """What this rank received (rank-major packed rows) as float8 rows of ``role`` of its
    experts, expert-major (``dispatched_rows``)."""
    fmt, buf = rows_format(config), received.index_select(0, plan.recv_order)  # expert-major
    # copies with row-major strides (.contiguous() keeps an empty slice's strides)
    data = buf.new_empty((buf.size(0), k)).copy_(buf[:, :k]).view(E4M3)
    scale = buf.new_empty((buf.size(0), buf.size(1) - k)).copy_(buf[:, k:])
    scale = fmt.scale_from_bytes(scale, _scale_format(config, ep))
    return dispatched_rows(data, scale, hp_dtype, fmt, role)


def _send_quantized(
    hp, token, plan: EPPlan, config: Float8ExpertsConfig, ep: EPConfig, role: GemmRole
):
    packed = pack_rows(hp, token, config, ep)
    received = _exchange(packed, plan.recv_sizes, plan.send_sizes, plan.group)
    return unpack_rows(received, plan, hp.size(1), config, ep, hp.dtype, role)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token, plan: EPPlan, config: Float8ExpertsConfig, ep: EPConfig):
        ctx.plan, ctx.x_shape = plan, x.shape
        ctx.save_for_backward(token)
        if ep.comm == "hp":
            return _to_experts(x[token], plan)
        return _send_quantized(x, token, plan, config, ep, GemmRole.INPUT)  # each cast once

    @staticmethod
    def backward(ctx, grad_rows):
        plan, (token,) = ctx.plan, ctx.saved_tensors
        back = _to_owners(grad_rows, plan)
        # x[token]'s own backward (index_put_ accumulating), so the sums of a token's rows
        # happen in the order one rank would add them
        grad_x = back.new_zeros(ctx.x_shape).index_put_((token,), back, accumulate=True)
        return grad_x, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ys, plan: EPPlan, config: Float8ExpertsConfig, ep: EPConfig, plain: bool):
        ctx.plan, ctx.config, ctx.ep, ctx.plain = plan, config, ep, plain
        return _to_owners(ys, plan)

    @staticmethod
    def backward(ctx, grad_rows):
        plan, config, ep = ctx.plan, ctx.config, ctx.ep
        grad_rows = grad_rows.contiguous()
        if ep.comm == "hp":
            return _to_experts(grad_rows, plan), None, None, None, None
        # the grad_input gemm's cast, along N, on the rank that owns the tokens
        rows = _send_quantized(grad_rows, None, plan, config, ep, GemmRole.GRAD_OUTPUT)
        # a compiled graph's backward takes plain tangents: the rows dequantized (exact), which
        # its gemm casts again to the same products (power-of-two scales)
        return rows.dequantize() if ctx.plain else rows, None, None, None, None


def dispatch(
    x: torch.Tensor,
    token: torch.Tensor,
    plan: EPPlan,
    config: Float8ExpertsConfig | None,
    ep: EPConfig = EPConfig(),
) -> torch.Tensor:
    """This rank's tokens ``x`` (T, K) to the ranks of their experts: row i of the sorted
    rows is ``x[token[i]]``. Returns the rows this rank's experts process, expert-major
    (their groups end at ``plan.offs``): float8 rows cast as ``config``'s first gemm
    casts them (``ep.comm="float8"``), or hp rows. ``config``: the float8 experts' config
    (``weight._config``), None for hp experts. Differentiable in ``x``."""
    if x.dim() != 2 or token.dim() != 1:
        raise ValueError(
            f"float8kit: dispatch takes x (tokens, dim) and token (rows,), got x "
            f"{tuple(x.shape)}, token {tuple(token.shape)}"
        )
    if token.numel() != plan.num_rows:
        raise ValueError(
            f"float8kit: dispatch got {token.numel()} rows but its plan routes {plan.num_rows}"
        )
    if ep.comm == "float8" and config is None:
        raise ValueError(
            'float8kit: EPConfig(comm="float8") sends rows cast for float8 experts, but these '
            "experts are hp (config None): convert them with "
            'convert_experts_to_float8_training, or use EPConfig(comm="hp")'
        )
    if ep.comm == "float8" and config.wgrad_operands != "dequantized":
        raise ValueError(
            'float8kit: EPConfig(comm="float8") sends float8 rows, which the experts\' '
            "weight-gradient gemm can only dequantize: set "
            'Float8ExpertsConfig.wgrad_operands="dequantized" on the experts, or '
            'EPConfig(comm="hp")'
        )
    return _Dispatch.apply(x, token, plan, config, ep)


def combine(
    ys: torch.Tensor, plan: EPPlan, config: Float8ExpertsConfig | None, ep: EPConfig = EPConfig()
) -> torch.Tensor:
    """The experts' outputs ``ys`` (expert-major rows, hp) back to the ranks that own the
    tokens: (rows, N) in the order of ``dispatch``'s ``token``. Its backward sends the
    gradient rows cast as the experts' grad_input gemm casts them (``ep.comm="float8"``).
    ``ys`` must be the output of the last expert gemm itself, used by nothing else, or of a
    compiled graph ending in it (which gets those rows dequantized: its gemm casts them
    again to the same products)."""
    if ys.dim() != 2 or ys.size(0) != plan.num_received:
        raise ValueError(
            f"float8kit: combine takes the {plan.num_received} rows this rank received, got "
            f"{tuple(ys.shape)}"
        )
    compiled = ys.grad_fn is not None and ys.grad_fn.name() == "CompiledFunctionBackward"
    if ep.comm == "float8" and ys.requires_grad and not (compiled or made_by_expert_gemm(ys)):
        raise ValueError(
            "float8kit: combine's input must be the output of the last float8 expert gemm "
            "itself (its backward sends that gemm float8 gradient rows), got the output of "
            f"{ys.grad_fn.name()}: apply routing scores before dispatch or after combine, add "
            'a bias or cast after combine, or use EPConfig(comm="hp")'
        )
    return _Combine.apply(ys, plan, config, ep, compiled)


# ---------------------------------------------------------------------------- the weights


def shard_experts(module: nn.Module, names: Sequence[str], group=None) -> tuple[int, int]:
    """Keep only this rank's experts of ``module``'s parameters ``names`` (experts along dim
    0; rank r of ``group`` keeps ``[r * E / ep, (r + 1) * E / ep)``), as plain local
    parameters. Call it before ``convert_experts_to_float8_training`` and before building the
    optimizer. Returns ``(first expert, experts kept)``.

    Checkpoints: see ``checkpoint_as_global``."""
    from torch.distributed.tensor import DTensor

    group = group or dist.group.WORLD
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = {getattr(module, n).size(0) for n in names}
    if len(sizes) != 1 or next(iter(sizes)) % ep:
        raise ValueError(
            f"float8kit: shard_experts needs {list(names)} to hold the same number of experts, "
            f"divisible by the {ep} expert-parallel ranks; got {sorted(sizes)}"
        )
    local = next(iter(sizes)) // ep
    for name in names:
        full = getattr(module, name)
        if isinstance(full, DTensor) or type(full.data) is not torch.Tensor:
            raise ValueError(
                f"float8kit: shard_experts({name!r}) got a {type(full.data).__name__}: shard "
                "the experts before converting them to float8 and before fully_shard"
            )
        mine = full.detach()[rank * local : (rank + 1) * local].clone()
        setattr(module, name, nn.Parameter(mine, requires_grad=full.requires_grad))
    checkpoint_as_global(module, names, group, local)
    return rank * local, local


@dataclasses.dataclass(frozen=True)
class _Sharding:
    """Experts ``[rank * local, (rank + 1) * local)`` of ``local * ep``, along dim 0."""

    mesh: object  # the group's DeviceMesh
    rank: int
    local: int
    ep: int

    def to_global(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's experts ``t`` as the global (E, ...) tensor: ``Shard(0)`` over the EP
        group, and, where FSDP2 shards them too (a DTensor over its dp mesh), ``Shard(0)``
        over the (ep, dp) mesh: each EP rank's experts cut again, as FSDP2 cuts them."""
        from torch.distributed.tensor import DTensor, Shard

        if not isinstance(t, DTensor):
            return DTensor.from_local(t, self.mesh, [Shard(0)], run_check=False)
        shape = (self.local * self.ep, *t.shape[1:])
        return DTensor.from_local(
            t._local_tensor, _ep_by_dp(self.mesh, _dp_mesh(t)), [Shard(0), Shard(0)],
            run_check=False, shape=shape, stride=torch.empty(shape, device="meta").stride(),
        )  # fmt: skip

    def to_local(self, value, like: torch.Tensor):
        """This rank's experts of a checkpoint's ``value``, shaped as ``like`` (the parameter,
        or its optimizer state: plain, or FSDP2's DTensor over dp): a DTensor of the global
        tensor (any placement), or a plain tensor of all experts (a checkpoint without expert
        parallelism); anything else as is."""
        from torch.distributed.tensor import DTensor, Shard

        whole = self.local * self.ep
        if isinstance(value, DTensor):
            # sharded as here (this process's, or this rank's own torch.save: its mesh is
            # the saving process's, read for nothing)
            mine = value._local_tensor
            fsdp = isinstance(like, DTensor)
            if value.placements == (Shard(0),) * (1 + fsdp) and value.size(0) == whole:
                if mine.shape == (like._local_tensor if fsdp else like).shape:
                    return _like(mine, like)
            value = value.full_tensor()
        if isinstance(value, torch.Tensor) and value.dim() and value.size(0) == whole:
            mine = value[self.rank * self.local : (self.rank + 1) * self.local]
            if isinstance(like, DTensor):  # FSDP2's cut of them: torch.chunk's
                dp = like.device_mesh
                step = -(-self.local // dp.size())
                start = min(dp.get_local_rank() * step, self.local)
                mine = mine[start : start + step]
            return _like(mine, like)
        return value


def _like(mine: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's ``mine`` as ``like`` holds it (FSDP2's DTensor over dp, or plain)."""
    from torch.distributed.tensor import DTensor

    return wrap_local(mine, like) if isinstance(like, DTensor) else mine


def _dp_mesh(t) -> object:
    """The 1-D mesh FSDP2 shards experts ``t`` over, along dim 0 (what checkpoints support)."""
    from torch.distributed.tensor import Shard

    if t.device_mesh.ndim != 1 or t.placements != (Shard(0),):
        raise ValueError(
            "float8kit: checkpoints of expert-parallel experts that FSDP2 also shards need "
            f"fully_shard on a 1-D mesh along dim 0; got placements {t.placements} on "
            f"{t.device_mesh}: use fully_shard(..., mesh=mesh['dp']) with the default "
            "shard_placement_fn"
        )
    return t.device_mesh


# (EP mesh, dp mesh) -> their (ep, dp) mesh
_EP_BY_DP: dict = {}


def _ep_by_dp(ep_mesh, dp_mesh):
    """The (ep, dp) mesh of experts cut by EP and then FSDP2: rank (e, d) holds FSDP2's
    shard d of EP rank e's experts. Built once from the two groups (no new process group);
    its layout, each dp rank's EP ranks, gathered over dp (collective over the dp group, as
    the checkpoint that first asks for it is)."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (ep_mesh, dp_mesh)
    if key not in _EP_BY_DP:
        rows = [None] * dp_mesh.size()
        mine = (dp_mesh.get_local_rank(), ep_mesh.mesh.tolist())
        dist.all_gather_object(rows, mine, group=dp_mesh.get_group())
        layout = torch.tensor([ranks for _, ranks in sorted(rows)]).t()  # [e][d]
        _EP_BY_DP[key] = DeviceMesh.from_group(
            [ep_mesh.get_group(), dp_mesh.get_group()], dp_mesh.device_type, mesh=layout,
            mesh_dim_names=("ep", "dp"),
        )  # fmt: skip
    return _EP_BY_DP[key]


# module -> (names, _Sharding) of the experts parameters cut by shard_experts /
# shard_hf_experts (their checkpoints and optimizer states show the global tensors)
_SHARDED = WeakIdKeyDictionary()
_HOOKED_OPTIMIZERS = WeakIdKeyDictionary()


def checkpoint_as_global(module: nn.Module, names: Sequence[str], group, local: int) -> None:
    """Checkpoints of ``module``'s expert-parallel parameters ``names`` (this rank's ``local``
    experts, along dim 0, of ``group``): ``module.state_dict()`` shows each as a DTensor of
    the global (E, ...) shape, ``Shard(0)`` over ``group`` (sharing the parameter's
    storage), and so does an optimizer's state of them (``exp_avg``, ...: hooked onto each
    optimizer holding them before its first step, which ``get_state_dict`` takes to
    initialize the state), so ``torch.distributed.checkpoint`` saves every expert once with its
    optimizer state, and loads both into any other expert-parallel degree (or none: a plain
    state_dict of the whole tensor loads too, each rank taking its slice). A rank's own
    ``torch.save`` of these state_dicts loads back on that rank."""
    from torch.distributed.device_mesh import DeviceMesh

    from float8kit.hp_weight import store_plain_weight

    mesh = DeviceMesh.from_group(group, getattr(module, names[0]).device.type)
    sharding = _Sharding(mesh, dist.get_rank(group), local, dist.get_world_size(group))
    _SHARDED[module] = (tuple(names), sharding)

    def to_global(mod, state_dict, prefix, local_metadata):
        for name in names:
            key = prefix + name
            if key in state_dict and not isinstance(state_dict[key], nn.Parameter):
                store_plain_weight(state_dict, prefix, name)  # a float8 expert weight's hp
                state_dict[key] = sharding.to_global(state_dict[key])

    def to_local(mod, state_dict, prefix, *args):
        for name in names:
            if prefix + name in state_dict:
                value = state_dict[prefix + name]
                state_dict[prefix + name] = sharding.to_local(value, getattr(mod, name))

    module.register_state_dict_post_hook(to_global)
    module.register_load_state_dict_pre_hook(to_local)


def _sharded_parameters() -> dict[nn.Parameter, _Sharding]:
    """Every expert-parallel parameter now (conversion to float8 replaces them)."""
    return {
        getattr(m, name): sharding for m, (names, sharding) in _SHARDED.items() for name in names
    }


def _optimizer_states(optimizer, state_dict, convert) -> None:
    # an optimizer state_dict's "state" is keyed as its param_groups list the parameters
    # (ids, or the FQNs of torch.distributed.checkpoint's state_dict), which pair with the
    # optimizer's own param_groups by position (Optimizer.load_state_dict); its
    # per-parameter dicts are the optimizer's own (state_dict()) or the caller's: new ones
    # replace them
    keys = (k for group in state_dict["param_groups"] for k in group["params"])
    params = (p for group in optimizer.param_groups for p in group["params"])
    sharded = _sharded_parameters()
    of_key = {k: p for k, p in zip(keys, params, strict=False) if p in sharded}
    states = dict(state_dict["state"])
    for key, values in states.items():
        if key in of_key:
            param = of_key[key]
            states[key] = {k: convert(sharded[param], v, param) for k, v in values.items()}
    state_dict["state"] = states


def _state_to_global(optimizer, state_dict):
    from torch.distributed.tensor import DTensor

    def convert(sharding, value, param):
        plain = isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, DTensor)
        return sharding.to_global(value) if plain and value.dim() else value

    _optimizer_states(optimizer, state_dict, convert)


def _state_to_local(optimizer, state_dict):
    _optimizer_states(optimizer, state_dict, _Sharding.to_local)


def _hook_optimizer(optimizer, args, kwargs) -> None:
    """Before an optimizer's first step: its checkpoints show its state of expert-parallel
    parameters as global DTensors (``checkpoint_as_global``), and a state loaded before (a
    rank's ``torch.save`` of them, loaded without hooks) becomes this rank's experts'."""
    if not _SHARDED or optimizer in _HOOKED_OPTIMIZERS:
        return
    sharded = _sharded_parameters()
    hooked = any(p in sharded for group in optimizer.param_groups for p in group["params"])
    _HOOKED_OPTIMIZERS[optimizer] = hooked
    if hooked:
        for param, state in optimizer.state.items():
            if param in sharded:
                for key, value in state.items():
                    state[key] = sharded[param].to_local(value, param)
        optimizer.register_state_dict_post_hook(_state_to_global)
        optimizer.register_load_state_dict_pre_hook(_state_to_local)


register_optimizer_step_pre_hook(_hook_optimizer)
