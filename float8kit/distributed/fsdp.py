"""FSDP2 float8 all-gather: a weight subclass that FSDP2 shards in hp and gathers in fp8.

With ``Float8LinearConfig.enable_fsdp_float8_all_gather=True`` a ``Float8Linear``'s weight
parameter holds a ``Float8AllGatherWeight`` around its hp tensor. Before each all-gather FSDP2
calls ``fsdp_pre_all_gather`` on the local shard, which casts it to float8 with scales that
are the full weight's (the same on every rank), so the all-gather moves the float8 bytes;
``fsdp_post_all_gather`` wraps the gathered bytes as the ``Float8TrainingTensor`` the gemms
use without casting again.

One lifecycle for every format, here: the hooks, the re-gather of a pass that has no
all-gather of its own (``regather``), the precomputed scale (``precompute_scales`` reduces
every weight's amaxes in one collective through ``fsdp_weight_contributions``; without a fresh
one the hook all-reduces itself) and refilling FSDP2's ``out`` on later all-gathers. What a
pass gathers is the weight's format's (``Format.all_gather_inputs`` and the methods after it,
float8kit.formats): tensorwise and rowwise cast the shard with their part of the full scale,
blockwise shards of whole blocks cast alone, MX gathers the copy of the pass (along K in
forward, along N in backward), NVFP4 its one 16x16-block copy as e2m1 codes. ``AllGather``
is what the lifecycle gives the format: the shard, where it sits, the layer's scale and the
collectives over the shard's ranks. Freshness of a precomputed scale is judged by signals
alike on every rank (the parameter's identity, its version, and the optimizer steps that
updated it). docs/fsdp.md explains each choice.

Internal, except ``fsdp_weight_contributions`` (the provider ``precompute_scales`` uses).
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from float8kit import cast as casting
from float8kit import formats, linear, state, versions
from float8kit.config import Float8LinearConfig, GemmRole, ScalingType
from float8kit.formats import Format, ShardSpec
from float8kit.hp_weight import HpWeight, padded_shard_size
from float8kit.reports import REPORT_CALLS, report_flags
from float8kit.tensor import Float8TrainingTensor
from float8kit.tensor import local as local_tensor

aten = torch.ops.aten


class Float8AllGatherWeight(HpWeight):
    """An hp weight that FSDP2 all-gathers in float8; internal.

    Invariants:
        - ``_tensor`` is the plain hp tensor this stands for: same shape, strides, dtype,
          device. Every aten op runs on ``_tensor``; results of ``KEEP_SUBCLASS`` ops are
          re-wrapped, in-place ops return the wrapper they mutated, all else is plain.
        - ``_config`` is the owning layer's config (a weight format with the FSDP2 float8
          all-gather capability, validated by ``Float8LinearConfig``).
        - ``data_ptr()`` is ``_tensor``'s (``float8kit.hp_weight``): trainers tell parameters
          apart by it.
        - It holds no scale state: FSDP2 may replace the local shard object (it re-pads
          uneven shards at lazy init and after ``load_state_dict``), so the precomputed scale
          lives on the module (``PrecomputedScale``).
    """

    _config: Float8LinearConfig

    def __repr__(self):
        return (
            f"Float8AllGatherWeight(hp={self.dtype}, shape={tuple(self.shape)}, "
            f"fp8={self._config.cast_config_weight.dtype_for(GemmRole.WEIGHT)})"
        )

    @property
    def _format(self) -> Format:
        return formats.weight(self._config.cast_config_weight)

    def __tensor_flatten__(self):
        return ["_tensor"], self._config

    @staticmethod
    def __tensor_unflatten__(inner_tensors, config, outer_size, outer_stride):
        return Float8AllGatherWeight(inner_tensors["_tensor"], config)

    # ------------------------------------------------------------------------ FSDP2 hooks

    def fsdp_pre_all_gather(
        self,
        mesh,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy,
    ) -> tuple[tuple[torch.Tensor, ...], tuple]:
        """Cast this local shard to float8 as its format gathers it; return the bytes.

        Called by FSDP2 (torch 2.13, 5-argument form) on the sharded local tensor.

        Args:
            mesh: the shard mesh (1-D) the all-gather runs over.
            outer_size: the unsharded weight's size.
            outer_stride: its contiguous strides (unused).
            module: the module owning the weight (where its scale state lives).
            mp_policy: FSDP2's MixedPrecisionPolicy (unused: the float8 cast reads the hp
                master shard directly, which is more precise than casting a bf16 copy).

        Returns:
            The format's ``all_gather_inputs``: the shard's bytes with FSDP2's *padded*
            sharded size (uneven sharding pads the last ranks' shards, an empty shard is all
            padding; raw uint8, which gloo can gather and FSDP2 can gather with hp biases in
            one buffer), and the metadata the post hook needs (the scales the gathered
            weight needs: the same on every rank).
        """
        fmt = self._format
        where = shard_spec(self.shape, outer_size, mesh, module, fmt)
        job = AllGather(
            module=module,
            shard_ref=weakref.ref(self._tensor),
            config=self._config,
            where=where,
            outer_size=torch.Size(outer_size),
            mesh=mesh,
            backward=_in_backward(),
        )
        module.fp8_state.last_all_gather = job
        _GATHERED.add(module)
        return fmt.all_gather_inputs(job)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: tuple,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ):
        """Wrap the gathered float8 bytes as the unsharded ``Float8TrainingTensor`` weight.

        Args:
            all_gather_outputs: the all-gather inputs of every rank, in order (padded).
            metadata: from ``fsdp_pre_all_gather``.
            param_dtype: the hp dtype the weight stands for in the gemms (FSDP2's
                ``mp_policy.param_dtype``, or the weight's own dtype).
            out: on later all-gathers, the weight built the first time: its data already
                views the (re-filled) all-gather buffers, so the format refills the rest
                in place (tensors derived from it share its scale).

        Returns:
            ``(weight, tensors)`` the first time (FSDP2 frees ``tensors``' storage when it
            reshards and refills it before the next use); None when ``out`` is given.
        """
        fmt = self._format
        if out is not None:
            fmt.refill(_built_weight(out), all_gather_outputs, metadata)
            return None
        config = self._config
        data, scale, gathered, free = fmt.all_gathered(all_gather_outputs, metadata, config)
        weight = Float8TrainingTensor(data, scale, param_dtype, GemmRole.WEIGHT, gathered, config)
        return weight, free


def _built_weight(out: torch.Tensor) -> Float8TrainingTensor:
    """The float8 tensor inside FSDP2's ``out`` (the weight the first all-gather built)."""
    weight = out._local_tensor if hasattr(out, "_local_tensor") else out
    if not isinstance(weight, Float8TrainingTensor):
        raise RuntimeError(
            f"float8kit: FSDP2 passed out={type(weight).__name__}, expected the float8 "
            "weight built by the first all-gather"
        )
    return weight


def _in_backward() -> bool:
    """Whether the autograd engine is running (FSDP2's pre-backward re-gather, its backward
    prefetch) rather than a forward: the pass an all-gather serves."""
    return torch._C._current_graph_task_id() != -1


def _layer(module: nn.Module) -> str:
    return f"{type(module).__name__}({module.extra_repr()})"


@dataclass(frozen=True, eq=False)
class AllGather:
    """One all-gather of a weight shard, as its format sees it (``Format.all_gather_inputs``):
    the shard and where it sits, the pass, the layer's scale state and the collectives over
    the shard's ranks (none on one rank)."""

    module: nn.Module
    shard_ref: weakref.ref  # the hp local shard (FSDP2 may replace it between steps)
    config: Float8LinearConfig
    where: ShardSpec
    outer_size: torch.Size  # FSDP2's unsharded size
    mesh: object  # FSDP2's 1-D shard mesh
    backward: bool  # the pass: backward (the autograd engine running) or forward

    @property
    def shard(self) -> torch.Tensor:
        return self.shard_ref()

    @property
    def world(self) -> int:
        return self.mesh.size()

    @property
    def group(self):
        return self.mesh.get_group() if self.world > 1 else None

    @property
    def layer(self) -> str:
        return _layer(self.module)

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.config.cast_config_weight.dtype_for(GemmRole.WEIGHT)

    @property
    def padded_rows(self) -> int:
        """FSDP2's padded shard size along dim 0."""
        return padded_shard_size(self.shard.shape, self.outer_size, self.world)[0]

    def pad(self, t: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """``t`` with zero rows added up to ``rows`` (FSDP2's padded shard rows)."""
        rows = self.padded_rows if rows is None else rows
        if t.shape[0] == rows:
            return t
        padded = t.new_zeros((rows, *t.shape[1:]))
        padded[: t.shape[0]].copy_(t)
        return padded

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` made the MAX over the shard's ranks, in place (one all-reduce)."""
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (same shape everywhere) stacked along dim 0: one all-gather."""
        if self.world == 1:
            return t
        out = t.new_empty((self.world * t.shape[0], *t.shape[1:]))
        getattr(dist, versions.ALL_GATHER_SINGLE)(out, t.contiguous(), group=self.group)
        return out

    def policy_scale(self) -> torch.Tensor:
        """The full weight's scale per the layer's policy (``weight_scale_for_all_gather``)."""
        return weight_scale_for_all_gather(self)

    def cast_own(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, scale)`` of the shard cast alone, as the layer casts a weight (for scales
        local to the shard)."""
        fp8 = casting.cast_to_float8(
            self.shard, self.config.cast_config_weight, GemmRole.WEIGHT, -1, self.config
        )
        return fp8._data, fp8._scale

    def kept_scale(self, amax_of_shard) -> torch.Tensor | None:
        """The scale kept for this weight while it is fresh (``PrecomputedScale.fresh``: by
        ``precompute_scales``, or by this forward's hook for a backward re-gather), else
        None. Using a ``precompute_scales`` scale records ``amax_of_shard()`` (the shard's
        amaxes as that scale was made from), so that the next ``precompute_scales`` reports a
        weight changed without any signal (``param.data``)."""
        kept = self.module.fp8_state.all_gather_scale
        if kept is None or not kept.fresh(self.module.weight, self.backward):
            return None
        if not kept.by_hook:
            kept.gathered_amax = amax_of_shard()
        return kept.scale

    def keep(self, scale: torch.Tensor, local_amax: torch.Tensor) -> torch.Tensor:
        """Keep ``scale`` (made from the shard's ``local_amax``) for this step's re-gathers."""
        self.module.fp8_state.all_gather_scale = PrecomputedScale(
            scale, *_stamp(self.module.weight), local_amax, by_hook=True
        )
        return scale


# modules whose weight FSDP2 all-gathered in float8 (their last ``AllGather`` is on their
# ``fp8_state``), and FSDP2's unsharded weight parameter -> its module (found once)
_GATHERED: weakref.WeakSet = weakref.WeakSet()
_MODULE_OF = WeakIdKeyDictionary()


def regather(weight: torch.Tensor, dim: int) -> Float8TrainingTensor | None:
    """The copy of the FSDP2 float8 all-gather weight ``weight`` (FSDP2's unsharded parameter,
    which holds the other copy) that the pass gathering along ``dim`` makes (0: backward, 1:
    forward), cast from the shards and all-gathered now, bitwise what the hook would gather;
    None when ``weight`` is no such parameter or its shard is gone.

    For a pass without its own FSDP2 all-gather, where a format gathers one copy per pass
    (MX): a backward after a forward that did not reshard (``reshard_after_forward=False``,
    FSDP2's root), or a forward recomputed in backward (activation checkpointing) after
    FSDP2's re-gather. Every rank runs the same layers' gemms in the same order, so every
    rank calls this alike."""
    module = _MODULE_OF.get(weight)
    if module is None:
        module = next((m for m in list(_GATHERED) if m.weight is weight), None)
        if module is None:
            return None
        _MODULE_OF[weight] = module
    job = replace(module.fp8_state.last_all_gather, backward=dim == 0)
    if job.shard is None:  # FSDP2 replaced the shard since: no all-gather since
        return None
    fmt = formats.weight(job.config.cast_config_weight)
    (data,), metadata = fmt.all_gather_inputs(job)
    data, scale, gathered, _ = fmt.all_gathered((job.all_gather_rows(data),), metadata, job.config)
    hp_dtype = local_tensor(weight)._orig_dtype
    return Float8TrainingTensor(data, scale, hp_dtype, GemmRole.WEIGHT, gathered, job.config)


# ---------------------------------------------------------------------------- scales


# float8 all-gather weight parameter -> how many optimizer steps have updated it. A foreach
# or fused optimizer (CUDA's default) updates a parameter without moving its version (its
# in-place ops reach the hp tensor below the wrapper's autograd): this count still moves.
_OPTIMIZER_STEPS = WeakIdKeyDictionary()


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    """After every ``torch.optim`` step: one more step for each watched weight it updates."""
    if not _OPTIMIZER_STEPS:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in _OPTIMIZER_STEPS:
                _OPTIMIZER_STEPS[p] += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def _stamp(param: torch.Tensor) -> tuple[weakref.ref, int, int]:
    """What a kept scale is valid for: the parameter, its version and its optimizer steps
    (from now on counted)."""
    steps = _OPTIMIZER_STEPS.setdefault(param, 0)
    return weakref.ref(param), param._version, steps


@dataclass
class PrecomputedScale:
    """A weight's next all-gather scale from ``precompute_scales``, stored on its module (or
    one a hook made and keeps for its pass's re-gather, ``by_hook``).

    Valid while the module's weight parameter is the same object at the same version, with
    no optimizer step on it, as when its amax was read: all change alike on every rank (see
    the module docstring). A scale a hook kept serves backward re-gathers only: a forward
    makes its own.

    An update through ``param.data`` (an EMA, some optimizers) changes the values without a
    version bump, and no rank can tell the others without a collective. So the hook cannot
    refuse the scale; instead it records the shard's group amaxes when it uses the scale
    (``gathered_amax``: one read of the local shard, no collective, no host sync), and the
    next ``precompute_scales`` compares them with ``local_amax``, the ones the scale was made
    from, and warns naming the layer (the scale is exactly stale when some group's amax
    moved on some rank). Tensorwise these are shape (), rowwise (N, 1) (see float8kit.formats).
    """

    scale: torch.Tensor
    param: weakref.ref
    version: int
    steps: int
    local_amax: torch.Tensor
    gathered_amax: torch.Tensor | None = None
    by_hook: bool = False

    def fresh(self, param: torch.Tensor, backward: bool) -> bool:
        return (
            self.param() is param
            and param._version == self.version
            and _OPTIMIZER_STEPS.get(param) == self.steps
            and (backward or not self.by_hook)
        )


def weight_scale_for_all_gather(job: AllGather) -> torch.Tensor:
    """The full weight's scale for this step's all-gather, identical on every rank of the
    shard mesh (``job.where``: the shard's place in the full weight; the shard is cast with
    its part of it, ``Format.shard_scale``).

    The scale itself comes from ``operand_scale`` (float8kit/linear.py), the decision every
    cast of the layer goes through; this function only supplies its inputs for a shard:

    - DYNAMIC (tensorwise or rowwise): the scale ``precompute_scales`` stored on ``module``
      (made by ``operand_scale`` from the all-reduced group amaxes), if the weight has not
      changed since; otherwise from the group amaxes of the whole weight, now, with one
      all-reduce.
    - STATIC: the layer's ``fp8_scale_weight`` buffer (replicated; no collective).
    - DELAYED: records the local shard's amax into ``fp8_amax_weight`` (train mode;
      ``precompute_scales``' single all_reduce(MAX) makes it the full weight's amax) and
      uses ``fp8_scale_weight``. Until ``precompute_scales`` has marked that scale set (the
      first step) the whole weight's amax is needed, with one all-reduce, like an
      un-precomputed DYNAMIC weight. The mark is a host flag that flips alike on every rank,
      so every rank makes the same choice, with no host read of the buffer.
    """
    module, config, where, shard = job.module, job.config, job.where, job.shard
    cast = config.cast_config_weight
    kind = cast.scaling_type
    groups, own = formats.weight(cast), module.fp8_state
    if kind is ScalingType.STATIC and "weight" in own.uncalibrated:
        raise RuntimeError(
            "float8kit: the STATIC weight scale of a float8 all-gather weight is not set: "
            "run float8kit.calibrate(model, batches) first, or set CastConfig.static_scale"
        )
    if kind is ScalingType.DYNAMIC:
        precomputed: PrecomputedScale | None = own.all_gather_scale
        if precomputed is not None:
            if precomputed.fresh(module.weight, job.backward):
                precomputed.gathered_amax = groups.group_amaxes(shard, where)
                return precomputed.scale
            warnings.warn(
                "float8kit: a weight changed after precompute_scales(); its float8 all-gather "
                "falls back to one all-reduce per weight. Call precompute_scales(model) after "
                "every optimizer.step() (and after loading weights).",
                stacklevel=2,
            )
            own.all_gather_scale = None
    state_scale, amax_record, scale_set = own.operand(module, GemmRole.WEIGHT, module.training)
    # Under tensor parallelism the DELAYED/STATIC buffers are replicated DTensors: their
    # local tensors share the storage (a recorded amax lands in the buffer).
    state_scale, amax_record = local_tensor(state_scale), local_tensor(amax_record)
    amax = None
    if casting.needs_amax(cast, amax_record is not None, scale_set):
        amax = groups.group_amaxes(shard, where)
        if kind is ScalingType.DYNAMIC or not scale_set:
            # the scale needs the whole weight's amax: over every mesh dim it is sharded on
            group = amax_group(module, job.mesh)
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return casting.operand_scale(
        cast, GemmRole.WEIGHT, config, amax, state_scale, amax_record, scale_set
    )


def mesh_group(mesh, layer: str = "") -> dist.ProcessGroup:
    """The process group of all ranks of ``mesh`` (a DeviceMesh of any dims): the mesh's own
    on a 1-D mesh, the default group when the mesh spans every rank, else the flattened
    mesh's (named dims needed: DeviceMesh._flatten)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    if not mesh.mesh_dim_names:
        raise ValueError(
            f"float8kit: {layer or 'float8 all-gather weights'} on the {mesh.ndim}-D mesh {mesh}: "
            "its amaxes need one all-reduce over all the mesh's ranks, which needs named dims "
            "(init_device_mesh(..., mesh_dim_names=...)); or pass precompute_scales(group=...)"
        )
    return mesh._flatten().get_group()


def amax_group(module: nn.Module, shard_mesh) -> dist.ProcessGroup:
    """The group over which a float8 all-gather weight's amaxes are reduced: every rank
    holding a part of it (FSDP2's shard mesh, and the TP / HSDP dims of its DTensor mesh)."""
    from torch.distributed.tensor import DTensor

    weight = module.weight
    if isinstance(weight, DTensor) and weight.device_mesh.ndim > 1:
        return mesh_group(weight.device_mesh, f"{type(module).__name__}({module.extra_repr()})")
    return shard_mesh.get_group() if shard_mesh.size() > 1 else None


def shard_spec(shard_shape: torch.Size, outer_size: torch.Size, mesh, module, fmt) -> ShardSpec:
    """Where this rank's shard of ``module.weight`` sits (``ShardSpec``), from FSDP2's shard
    ``mesh`` and outer size and the weight's DTensor placements (tensor parallel / HSDP
    dims); remembers ``mesh`` on ``module`` for ``precompute_scales``. Raises where the
    weight's format ``fmt`` needs dim-0 shards and FSDP2 shards another dim."""
    from torch.distributed.tensor import DTensor

    module.fp8_state.shard_mesh = mesh
    rank, world = 0 if mesh.size() == 1 else mesh.get_local_rank(), mesh.size()
    weight, outer = module.weight, {}
    if isinstance(weight, DTensor) and weight.device_mesh.ndim > 1:
        spmd = weight.device_mesh
        outer_shape, outer_offset, fsdp_dim = _outer_weight(weight, mesh)
        if tuple(outer_shape) != tuple(outer_size):
            raise ValueError(
                f"float8kit: float8 all-gather weight ({module.extra_repr()}) on mesh {spmd}: "
                f"FSDP2's unsharded size {tuple(outer_size)} is not the weight's shard "
                f"{tuple(outer_shape)} on the mesh dims other than FSDP2's shard dim"
            )
        coord = spmd.get_coordinate()
        slot, n_slots = 0, 1
        for d in (d for d in range(spmd.ndim) if d != fsdp_dim):
            slot, n_slots = slot * spmd.size(d) + coord[d], n_slots * spmd.size(d)
        outer = dict(full_shape=weight.shape, outer_offset=outer_offset, slot=slot, n_slots=n_slots)
    where = ShardSpec.of(shard_shape, outer_size, rank, world, **outer)
    if where.dim not in (None, 0) and not fmt.shards_any_dim:
        # alike on every rank (FSDP2 shards other dims evenly), before any collective
        raise ValueError(
            f"float8kit: {_layer(module)}: a {fmt.short()} float8 all-gather weight must be "
            f"sharded along dim 0 (FSDP2's default); FSDP2 shards it along dim {where.dim} "
            f"over mesh {mesh}: drop the shard_placement_fn for it, or set "
            "enable_fsdp_float8_all_gather=False"
        )
    return where


def _outer_weight(weight, shard_mesh) -> tuple[torch.Size, tuple[int, ...], int]:
    """The outer weight of a DTensor ``weight`` on a multi-dim mesh: the DTensor with FSDP2's
    dim replicated (the TP shard, or all of it), as (its shape, its offset in the full
    weight, FSDP2's ``shard_mesh`` dim of the weight's mesh)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    spmd = weight.device_mesh
    d = _fsdp_mesh_dim(spmd, shard_mesh)
    placements = [Replicate() if i == d else p for i, p in enumerate(weight.placements)]
    shape, offset = compute_local_shape_and_global_offset(weight.shape, spmd, placements)
    return torch.Size(shape), tuple(offset), d


def _fsdp_mesh_dim(spmd, shard_mesh) -> int:
    """The dim of the weight's DeviceMesh ``spmd`` that is FSDP2's 1-D ``shard_mesh``."""
    ranks = shard_mesh.mesh.flatten().tolist()
    coord = spmd.get_coordinate()
    for d in range(spmd.ndim):
        index = tuple(slice(None) if i == d else c for i, c in enumerate(coord))
        if spmd.mesh[index].flatten().tolist() == ranks:
            return d
    raise ValueError(f"float8kit: FSDP2's shard mesh {shard_mesh} is not a dim of {spmd}")


def _precompute_spec(m: nn.Module) -> ShardSpec | None:
    """``m``'s shard placement for ``precompute_scales``: from FSDP2's shard mesh that the
    hook remembered, or the weight's own mesh when 1-D; None on a multi-dim mesh before the
    first all-gather (alike on every rank: the hook then reduces itself)."""
    weight = m.weight
    mesh = m.fp8_state.shard_mesh
    if mesh is None:
        if weight.device_mesh.ndim != 1:
            return None
        mesh = weight.device_mesh
    shard = weight._local_tensor
    # the outer size is the global one with the non-FSDP dims' sharding applied
    outer = weight.shape if weight.device_mesh.ndim == 1 else _outer_weight(weight, mesh)[0]
    return shard_spec(shard._tensor.shape, torch.Size(outer), mesh, m, shard._format)


def _sharded_fp8_linears(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(fqn, module) of every Float8Linear in ``module`` whose weight FSDP2 sharded with
    float8 all-gather."""
    from torch.distributed.tensor import DTensor

    return [
        (fqn or "<root>", mod)
        for fqn, mod in module.named_modules()
        if isinstance(mod, linear.Float8Linear)
        and isinstance(mod.weight, DTensor)
        and isinstance(mod.weight._local_tensor, Float8AllGatherWeight)
    ]


def _report_stale_weights(mods: list[tuple[str, nn.Module]]) -> None:
    """Warn (at the latest one call later on CUDA, with no host sync) about the weights whose
    last all-gather used a precomputed scale they had outgrown (see ``PrecomputedScale``)."""
    used = []
    for name, m in mods:
        p = m.fp8_state.all_gather_scale
        if p is not None and p.gathered_amax is not None:
            used.append((p, name))
    if not used:
        return
    changed = torch.stack([(p.gathered_amax != p.local_amax).any() for p, _ in used])
    report_flags(REPORT_CALLS, changed, "stale_weight", "\n".join(n for _, n in used))


@torch.no_grad()
def fsdp_weight_contributions(module: nn.Module) -> list[state.Contribution]:
    """``precompute_scales``' provider for FSDP2 float8 all-gather weights.

    One contribution for all of them: the local shards' amaxes of every DYNAMIC weight whose
    format precomputes its all-gather scale (``Format.precomputes``; tensorwise: one each,
    in one batched pass; rowwise: one per row of the full weight, 0 for the rows other ranks
    own; NVFP4: its block-amax grid, see ``float8kit.formats``), and an ``apply`` that turns
    the all-reduced amaxes into next-step scales (``Format.precomputed_scales``, one call per
    format and cast) and stores each on its module, stamped with the weight version it was
    read at.

    Args:
        module: the (FSDP2-wrapped) model.

    Returns:
        ``[(amaxes, apply)]``, or ``[]`` when nothing is sharded with float8 all-gather.
    """
    sharded = _sharded_fp8_linears(module)
    if not sharded:
        return []
    _report_stale_weights(sharded)
    # Weights grouped by format and scale computation (cast, power-of-2 rounding), ordered
    # group by group, so each group is one slice of the amaxes: no index tensor to copy to
    # the device.
    groups: dict[tuple, list[tuple[nn.Module, ShardSpec]]] = {}
    for _, m in sharded:
        # the config the weight is gathered with (the layer's, unless set_hp_forward switched
        # the layer's output gemm to hp since: its weight is still gathered as before)
        gather_config = m.weight._local_tensor._config
        cast = gather_config.cast_config_weight
        if cast.scaling_type is not ScalingType.DYNAMIC:
            continue
        where = _precompute_spec(m)
        if where is None:
            continue
        fmt = formats.weight(cast)
        mesh = m.fp8_state.shard_mesh or m.weight.device_mesh
        if fmt.precomputes(where, mesh.size()):
            key = (fmt, cast, gather_config.round_scales_to_power_of_2)
            groups.setdefault(key, []).append((m, where))
    if not groups:
        return []
    pieces, plan = [], []
    for (fmt, _, _), rows in groups.items():
        shards = [m.weight._local_tensor._tensor for m, _ in rows]
        got, shapes = fmt.precompute_amaxes(shards, [where for _, where in rows])
        pieces += got
        plan.append((fmt, [m for m, _ in rows], shapes))
    amaxes = torch.cat(pieces)
    mods = [m for _, rows, _ in plan for m in rows]
    stamps = [_stamp(m.weight) for m in mods]

    def apply(reduced: torch.Tensor) -> None:
        start, i = 0, 0
        for fmt, rows, shapes in plan:
            stop = start + sum(math.prod(s) for s in shapes)
            config = rows[0].weight._local_tensor._config
            scales = fmt.precomputed_scales(
                reduced[start:stop], shapes, config.cast_config_weight, config
            )
            for m, scale, shape in zip(rows, scales, shapes, strict=True):
                n = math.prod(shape)
                local = amaxes[start : start + n].reshape(shape)
                m.fp8_state.all_gather_scale = PrecomputedScale(scale, *stamps[i], local)
                start, i = start + n, i + 1

    return [(amaxes, apply)]


# ---------------------------------------------------------------------------- Float8Linear


# original parameter -> its wrapped parameter: layers that share (tie) a weight share the
# wrapped parameter too, so the tie survives conversion (one parameter for the optimizer and
# for FSDP2, not two on one storage).
_WRAPPED = WeakIdKeyDictionary()


def wrap_weight(weight: nn.Parameter, config: Float8LinearConfig) -> nn.Parameter:
    """``weight`` as a parameter holding a ``Float8AllGatherWeight`` (same storage); the same
    wrapped parameter for every layer that shares ``weight``."""
    if isinstance(weight, Float8AllGatherWeight):
        return weight
    wrapped = _WRAPPED.get(weight)
    if wrapped is not None:
        if wrapped._config != config:
            raise ValueError(
                "float8kit: layers that share (tie) a weight need the same Float8LinearConfig "
                "with enable_fsdp_float8_all_gather=True (the weight is gathered once)"
            )
        return wrapped
    # a FakeTensor stands for a plain tensor (tracing without a device: tests/test_fake_cuda)
    if type(weight.data) not in (torch.Tensor, FakeTensor):
        raise TypeError(
            "float8kit: enable_fsdp_float8_all_gather needs a plain tensor weight; got "
            f"{type(weight.data).__name__} (convert to float8 before fully_shard / "
            "parallelize_module)"
        )
    wrapped = nn.Parameter(
        Float8AllGatherWeight(weight.detach(), config), requires_grad=weight.requires_grad
    )
    _WRAPPED[weight] = wrapped
    return wrapped


linear.register_fsdp(wrap_weight, regather)
