"""``precompute_scales``: the per-step scale update, after ``optimizer.step()``.

Built around *contributions*. A contribution is ``(local_amaxes, apply)``: a 1-D fp32 tensor
of amaxes this rank saw, and a function that takes the same amaxes reduced (max) over all
ranks and writes the scales from them. ``precompute_scales`` asks every provider in
``_PROVIDERS`` for its contributions, concatenates their amaxes, does ONE
``all_reduce(MAX)`` when torch.distributed runs with more than one rank, and hands each
``apply`` its slice. Adding a kind of scale state is one more provider in that list.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from float8kit import scaling, state
from float8kit.config import ScalingType
from float8kit.distributed.fsdp import fsdp_weight_contributions, mesh_group
from float8kit.linear import Float8Linear
from float8kit.reports import REPORT_CALLS, SCALES_SET, report_flags
from float8kit.tensor import local as local_tensor

Contribution = state.Contribution


def _delayed_contributions(module: nn.Module) -> list[Contribution]:
    """One contribution for every DELAYED amax record of every Float8Linear in ``module``
    (``_DelayedPlan``: kept per module while its layers and their state are the same)."""
    layers = [(n or "<root>", m) for n, m in module.named_modules() if isinstance(m, Float8Linear)]
    plan = _PLANS.get(module)
    if plan is None or not plan.current(layers):
        plan = _PLANS[module] = _DelayedPlan(layers)
    return plan.contributions([m for _, m in layers])


class _DelayedPlan:
    """Where the DELAYED state of a module's Float8Linear layers lives, found once.

    ``precompute_scales`` runs every step, and asking each layer's config for its DELAYED
    casts and looking up their buffers was most of its host time per layer. The plan keeps
    what that found, and no module (it is kept in a ``WeakKeyDictionary`` of the modules:
    a value naming its key would keep it alive). ``current`` checks it at each call against
    that call's walk of the tree: the same layers under the same names, each with the config
    and buffers the plan holds (``module.to()``, ``to_empty``, ``load_state_dict(assign=True)``
    replace buffers; FSDP2 moves them in place, the device is checked too).

    ``contributions`` hands ``precompute_scales`` the stacked amax records and an ``apply`` that
    folds the reduced records into the amax histories and recomputes the scales with a few
    batched ops per group of histories that share (length, max/most recent, power-of-2 rounding;
    e4m3 and e5m2 rows alike, ``scaling.row_constants``), writes them back with
    ``torch._foreach_copy_``, clears the records and the layers' stale-forward counts.
    Non-finite records are not folded in (see ``scaling.update_amax_history``) and make it warn,
    naming the layers. Every layer updates its own state, tied ones too (``state.Tie``: their
    records are their own); the ties are settled after the scales are written. Scales not yet
    marked set on the host (``LayerState.scales_set``) are checked (``>= 0``) and marked by
    ``SCALES_SET``; once every scale is marked, nothing is read back to the host at all.
    """

    def __init__(self, layers: list[tuple[str, Float8Linear]]):
        self.ids = [(n, id(m)) for n, m in layers]
        self.checks, records = [], []
        for i, (fqn, mod) in enumerate(layers):
            pow2, names = mod.config.round_scales_to_power_of_2, []
            for role, cast in state.stateful_casts(mod.config, ScalingType.DELAYED):
                # rows of one group share their ops (of both float8 dtypes: row_constants)
                key = (cast.amax_history_len, cast.delayed_scale_from == "max", pow2)
                names += [state.amax_name(role), state.history_name(role), state.scale_name(role)]
                # Under tensor parallelism the buffers are replicated DTensors: update their
                # local tensors (same storage).
                amax, history, scale = (local_tensor(mod._buffers[n]) for n in names[-3:])
                operand = state.OPERAND_NAMES[role]
                row = (key, f"{fqn}.{operand}", amax, history, scale, (i, operand))
                records.append((*row, cast.dtype_for(role)))
            self.checks.append((i, mod.config, names, tuple(mod._buffers[n] for n in names)))
        # Order the records group by group, so each group is one slice of the stacked amaxes.
        groups: dict[tuple, list] = {}
        for r in records:
            groups.setdefault(r[0], []).append(r)
        self.groups = []  # (rows, from_max, pow2, the rows' scaling.row_constants)
        for (_, from_max, pow2), rows in groups.items():
            constants = scaling.row_constants([r[6] for r in rows], rows[0][3].device)
            self.groups.append((len(rows), from_max, pow2, constants))
        records = [r[:6] for rows in groups.values() for r in rows]
        columns = list(zip(*records, strict=True)) or [()] * 6
        _, names, self.pending, self.histories, self.scales, self.owners = map(list, columns)
        self.names = "\n".join(names)
        self.delayed = sorted({i for i, _ in self.owners})  # the layers with DELAYED casts
        self.device = self.histories[0].device if self.histories else None

    def current(self, layers: list[tuple[str, Float8Linear]]) -> bool:
        """Whether ``layers`` and their state are as the plan found them (the class doc)."""
        if [(n, id(m)) for n, m in layers] != self.ids:
            return False
        if self.histories and self.histories[0].device != self.device:
            return False
        for i, config, names, buffers in self.checks:
            mod = layers[i][1]
            if mod.config is not config:
                return False
            if not all(map(operator.is_, map(mod._buffers.get, names), buffers)):
                return False
        return True

    def contributions(self, layers: list[Float8Linear]) -> list[Contribution]:
        if not self.pending:
            return []
        local = torch.stack(self.pending).to(torch.float32)
        unmarked = [
            (row, [(layers[i], operand)])
            for row, (i, operand) in enumerate(self.owners)
            if operand not in layers[i].fp8_state.scales_set
        ]
        tied = [mod for mod in layers if mod.fp8_state.tie is not None]
        counts = [layers[i].fp8_state.forward_count for i in self.delayed]
        histories, scales, pending = self.histories, self.scales, self.pending

        @torch.no_grad()
        def apply(reduced: torch.Tensor) -> None:
            new_histories, new_scales = [], []
            start = 0
            for rows, from_max, pow2, constants in self.groups:
                stop = start + rows
                hist = torch.stack(histories[start:stop])
                hist = scaling.update_amax_history(hist, reduced[start:stop])
                scale = scaling.history_to_scale(hist, constants, from_max, pow2)
                new_histories += hist.unbind(0)
                new_scales += scale.unbind(0)
                start = stop
            torch._foreach_copy_(histories, new_histories)
            torch._foreach_copy_(scales, new_scales)
            unset = torch.full((), scaling.UNSET, device=reduced.device)
            torch._foreach_copy_(pending, [unset] * len(pending))
            if tied:  # ties whose layers' new scales are known equal stay (host bookkeeping)
                state.settle_ties(tied)
            torch._foreach_zero_(counts)
            report_flags(REPORT_CALLS, ~torch.isfinite(reduced), "non_finite", self.names)
            if unmarked:
                is_set = torch.stack([new_scales[row] for row, _ in unmarked]) >= 0
                SCALES_SET.submit(is_set, [target for _, target in unmarked])

        return [(local, apply)]


# The plan of each module precompute_scales was called with (weakly: a dropped model goes).
_PLANS: weakref.WeakKeyDictionary[nn.Module, _DelayedPlan] = weakref.WeakKeyDictionary()
# Every kind of scale state that precompute_scales updates: fn(module) -> contributions.
_PROVIDERS: list[Callable[[nn.Module], list[Contribution]]] = [
    _delayed_contributions,  # DELAYED amax records (input, weight, grad_output)
    fsdp_weight_contributions,  # FSDP2 float8 all-gather weight shards (distributed/fsdp.py)
]


def _default_group(module: nn.Module) -> dist.ProcessGroup | None:
    """All ranks of the model's widest DeviceMesh: the mesh of its DTensor parameter with
    the most dims (FSDP2's mesh; on a 2-D (dp, tp) mesh or HSDP, every rank of it, since a
    tensorwise weight sharded over dp and tp needs the max over both, even where norms or the
    embedding are dp-only). None (the default group) when nothing is a DTensor."""
    from torch.distributed.tensor import DTensor

    widest = None
    for p in module.parameters():
        if isinstance(p, DTensor) and (widest is None or p.device_mesh.ndim > widest.ndim):
            widest = p.device_mesh
    return None if widest is None else mesh_group(widest)


def precompute_scales(module: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
    """Compute every scale the next step needs, with at most one collective.

    Call it right after ``optimizer.step()``. It folds the amaxes that DELAYED layers
    recorded this step into their histories and recomputes their scales, and computes the
    scale of every FSDP2 float8 all-gather weight from its shards' amaxes. With
    torch.distributed initialized and more than one rank, all these amaxes go through one
    ``all_reduce(MAX)``, so every rank gets the same scales. With nothing to update (only
    dynamic or static scaling, no float8 all-gather) it returns at once, without a collective.

    Args:
        module: the (possibly FSDP2-wrapped and compiled) model.
        group: process group of the all-reduce; default: every rank of the model's widest
            DeviceMesh (the FSDP2 mesh; on a 2-D (dp, tp) mesh or HSDP all dp x tp, or
            replicate x shard, ranks; the flattened mesh when it spans fewer than all
            ranks), else the default group.
    """
    # Scale-set flags from an earlier call, before the providers read them.
    SCALES_SET.poll()
    contributions = [c for provider in _PROVIDERS for c in provider(module)]
    if not contributions:
        return
    local = torch.cat([amaxes.reshape(-1).to(torch.float32) for amaxes, _ in contributions])
    if dist.is_available() and dist.is_initialized():
        group = group if group is not None else _default_group(module)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    sizes = [amaxes.numel() for amaxes, _ in contributions]
    pieces = local.split(sizes) if len(sizes) > 1 else [local]
    for (_, apply), reduced in zip(contributions, pieces, strict=True):
        apply(reduced)


# torchao's name, so scripts written for torchao switch by changing the import.
precompute_float8_dynamic_scale_for_fsdp = precompute_scales
