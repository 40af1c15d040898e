"""FSDP2 float8 all-gather: a weight subclass that FSDP2 shards in hp and gathers in fp8.

With ``Float8LinearConfig.enable_fsdp_float8_all_gather=True`` a ``Float8Linear``'s weight
parameter holds a ``Float8AllGatherWeight`` around its hp tensor. Before each all-gather FSDP2
calls ``fsdp_pre_all_gather`` on the local shard, which casts it to fp8 with a scale that is
the same on every rank (the full weight's: ``precompute_scales`` reduces every weight's amaxes
in one collective through ``fsdp_weight_contributions``; without a fresh one the hook
all-reduces itself), so the all-gather moves 1 byte per element; ``fsdp_post_all_gather``
wraps the gathered bytes as the ``Float8TrainingTensor`` the gemms use without casting again.
Shards of whole blocks (blockwise) cast alone and gather their block scales with the bytes.
MX weights gather the copy of the pass the all-gather serves (along K in forward, along N in
backward): float8kit.distributed.fsdp_mx. NVFP4 weights gather their one 16x16-block copy as
e2m1 codes, packed two per byte on even shards: float8kit.distributed.fsdp_nvfp4.
How a granularity's scaling groups map onto shards and meshes is its granularity object's
(float8kit.formats); freshness of a precomputed scale is judged by signals alike on every
rank (the parameter's identity and version). docs/fsdp.md explains each choice.

Internal, except ``fsdp_weight_contributions`` (the provider ``precompute_scales`` uses).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.weak import WeakIdKeyDictionary

from float8kit import cast as casting
from float8kit import formats, linear, scaling, state
from float8kit.config import Float8LinearConfig, GemmRole, ScalingGranularity, ScalingType
from float8kit.distributed import fsdp_mx, fsdp_nvfp4
from float8kit.formats import ShardSpec
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
        - ``_config`` is the owning layer's config (a tensorwise, rowwise, blockwise or MX float8
          weight, validated by ``Float8LinearConfig``).
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
            f"fp8={self._fp8_dtype})"
        )

    @property
    def _fp8_dtype(self) -> torch.dtype:
        return self._config.cast_config_weight.dtype_for(GemmRole.WEIGHT)

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
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor]]:
        """Cast this local shard to fp8 with the replicated scale; return its bytes.

        Called by FSDP2 (torch 2.13, 5-argument form) on the sharded local tensor.

        Args:
            mesh: the shard mesh (1-D) the all-gather runs over.
            outer_size: the unsharded weight's size.
            outer_stride: its contiguous strides (unused).
            module: the module owning the weight (where a delayed/static scale would live).
            mp_policy: FSDP2's MixedPrecisionPolicy (unused: the fp8 cast reads the hp
                master shard directly, which is more precise than casting a bf16 copy).

        Returns:
            ``((data_uint8,), (scale,))``: the fp8 shard as raw bytes with FSDP2's *padded*
            sharded size (uneven sharding pads the last ranks' shards, an empty shard is all
            padding), and the scale the gathered weight needs (the full weight's: shape ()
            tensorwise, (N, 1) rowwise; the same on every rank).
        """
        cast = self._config.cast_config_weight
        where = shard_spec(self.shape, outer_size, mesh, module)
        if where.dim not in (None, 0) and cast.scaling_granularity is not (
            ScalingGranularity.TENSORWISE
        ):
            # alike on every rank (FSDP2 shards other dims evenly), before any collective
            raise ValueError(
                f"float8kit: {type(module).__name__}({module.extra_repr()}): a "
                f"{cast.scaling_granularity.value} float8 all-gather weight must be sharded "
                f"along dim 0 (FSDP2's default); FSDP2 shards it along dim {where.dim} over "
                f"mesh {mesh}: drop the shard_placement_fn for it, or set "
                "enable_fsdp_float8_all_gather=False"
            )
        if cast.is_nvfp4:  # e2m1 codes, 16x16 blocks: one copy for both passes
            group = mesh.get_group() if mesh.size() > 1 else None
            return fsdp_nvfp4.pre_all_gather(
                module, self._tensor, outer_size, mesh.size(), group, where
            )
        if cast.is_mx:  # this pass's copy (along K forward, along N backward): fsdp_mx
            group = mesh.get_group() if mesh.size() > 1 else None
            return fsdp_mx.pre_all_gather(
                module, self._tensor, self._config, outer_size, mesh.size(), group, where
            )
        groups = formats.weight(cast)
        if self._block_size is not None and not groups.cuts(outer_size[0], mesh.size()):
            return self._pre_all_gather_blocks(mesh, outer_size)
        scale = weight_scale_for_all_gather(self, mesh, module, where)
        shard_scale = groups.shard_scale(scale, self._tensor, where)
        data = casting.cast_with_scale(self._tensor, shard_scale, self._fp8_dtype)
        # Raw bytes: gloo cannot gather float8 dtypes ("Invalid scalar type"), and a uniform
        # uint8 input lets FSDP2 gather fp8 weights and hp biases in one uint8 buffer.
        data = data.view(torch.uint8)
        padded_size = padded_shard_size(self.shape, outer_size, mesh.size())
        if data.shape != padded_size:
            padded = data.new_zeros(padded_size)
            padded[: data.size(0)].copy_(data)
            data = padded
        scale = groups.gathered_scale(scale, where)  # the outer (FSDP2-unsharded) weight's
        if self._block_size is not None:  # blocks cut by the shards: whole-block scales
            return (data,), (scale, outer_size[0])
        return (data,), (scale,)

    @property
    def _block_size(self) -> int | None:
        """The row count of a scale block of this weight (None: not block-scaled)."""
        block = formats.weight(self._config.cast_config_weight).block
        return None if block is None else block[0]

    def _pre_all_gather_blocks(self, mesh, outer_size: torch.Size):
        """The blockwise ``fsdp_pre_all_gather`` for shards of whole blocks: every scale is
        local to its shard (``local_scale_inputs``)."""
        config = self._config
        fp8 = casting.cast_to_float8(
            self._tensor, config.cast_config_weight, GemmRole.WEIGHT, -1, config
        )
        chunk = padded_shard_size(self.shape, outer_size, mesh.size())
        return local_scale_inputs(fp8._data, fp8._scale, chunk[0], self._block_size, mesh.size())

    def _post_all_gather_blocks(self, all_gather_outputs, metadata, param_dtype, out):
        c = self._config
        gran = formats.weight(c.cast_config_weight)
        if len(all_gather_outputs) == 1 and len(metadata) > 1:
            # shards that cut blocks: the whole-block scales came as metadata (replicated);
            # drop the padding rows (a view, as rowwise below)
            (data,), (scale, rows) = all_gather_outputs, metadata
            if out is not None:
                _refill_scale(out, scale)
                return None
            fp8 = data[:rows].view(self._fp8_dtype)
            weight = Float8TrainingTensor(fp8, scale.clone(), param_dtype, GemmRole.WEIGHT, gran, c)
            return weight, (data,)
        got = local_scale_outputs(all_gather_outputs, metadata, self._fp8_dtype, out)
        if got is None:
            return None
        data, scale, free = got
        return Float8TrainingTensor(data, scale, param_dtype, GemmRole.WEIGHT, gran, c), free

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: tuple[torch.Tensor],
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ):
        """Wrap the gathered fp8 bytes as the unsharded ``Float8TrainingTensor`` weight.

        Args:
            all_gather_outputs: ``(data_uint8,)``, the padded shards of every rank in order.
            metadata: ``(scale,)`` from ``fsdp_pre_all_gather``.
            param_dtype: the hp dtype the weight stands for in the gemms (FSDP2's
                ``mp_policy.param_dtype``, or the weight's own dtype).
            out: on later all-gathers, the weight built the first time: its data already
                views the (re-filled) all-gather buffer, so only its scale is updated, in
                place (tensors derived from it share the scale tensor).

        Returns:
            ``(weight, (data,))`` the first time (FSDP2 frees ``data``'s storage when it
            reshards and refills it before the next use); None when ``out`` is given.
        """
        if self._config.cast_config_weight.is_nvfp4:
            return fsdp_nvfp4.post_all_gather(
                all_gather_outputs, metadata, param_dtype, self._config, out
            )
        if self._config.cast_config_weight.is_mx:
            return fsdp_mx.post_all_gather(
                all_gather_outputs, metadata, param_dtype, self._config, out
            )
        if self._block_size is not None:
            return self._post_all_gather_blocks(all_gather_outputs, metadata, param_dtype, out)
        (data,) = all_gather_outputs
        (scale,) = metadata
        if out is not None:
            _refill_scale(out, scale)
            return None
        data = data.view(self._fp8_dtype)
        gran = formats.weight(self._config.cast_config_weight)
        # Rowwise: drop the padding rows here (a view: FSDP2 frees and refills ``data``'s
        # storage), so the weight has one scale per row; FSDP2's as_strided to the full size
        # is then the identity.
        fp8 = data if gran.axiswise_dim is None else data[: scale.shape[0]]
        # clone: the scale may be the precomputed one, which must not alias the weight's.
        weight = Float8TrainingTensor(
            fp8, scale.clone(), param_dtype, GemmRole.WEIGHT, gran, self._config
        )
        return weight, (data,)


def local_scale_inputs(
    data: torch.Tensor, scale: torch.Tensor, padded_rows: int, rows_per_scale: int, world: int
):
    """``fsdp_pre_all_gather``'s return for a float8 shard whose scales are its own (a dense
    weight's whole blocks, an expert weight's per-expert scales): the fp8 bytes and the fp32
    scales' bytes as two uint8 all-gather inputs, both padded along dim 0 to FSDP2's padded
    shard size (``padded_rows`` data rows; a padding scale is 1.0). On one rank FSDP2 copies
    only the first all-gather input, so the scales go as metadata there instead."""
    data = data.view(torch.uint8)
    if padded_rows != data.shape[0]:  # uneven: the last ranks' shards are padded
        pad = padded_rows - data.shape[0]
        data = torch.nn.functional.pad(data, (0, 0) * (data.dim() - 1) + (0, pad))
        pad = padded_rows // rows_per_scale - scale.shape[0]
        scale = torch.nn.functional.pad(scale, (0, 0) * (scale.dim() - 1) + (0, pad), value=1.0)
    if world == 1:
        return (data,), (scale,)
    return (data, scale.contiguous().view(torch.uint8)), ()


def local_scale_outputs(all_gather_outputs, metadata, fp8_dtype: torch.dtype, out):
    """``(data, scale, tensors to free)`` from what ``local_scale_inputs`` sent, for the post
    hook to wrap; None on a re-gather (``out``), where the weight's data and scales view the
    buffers FSDP2 refilled (on one rank, the scales from metadata are copied in place)."""
    if len(all_gather_outputs) == 1:  # one rank: the scales came as metadata
        (data,), (scale,) = all_gather_outputs, metadata
        if out is not None:
            _refill_scale(out, scale)
            return None
        return data.view(fp8_dtype), scale.clone(), (data,)
    if out is not None:
        return None
    data, scale_bytes = all_gather_outputs
    data, scale = data.view(fp8_dtype), scale_bytes.view(torch.float32)
    return data, scale, (data, scale)


def _refill_scale(out: torch.Tensor, scale: torch.Tensor) -> None:
    """A re-gather (FSDP2's ``out``): copy the new scale into the weight built by the first
    all-gather, whose data already views the refilled all-gather buffer.

    In place, without a version bump, the way FSDP2 refills the data bytes. Autograd may
    have saved this scale in the forward (compiled graphs with activation checkpointing save
    graph inputs, not derived tensors), and the backward re-gather must not invalidate it.
    Sound for the same reason as FSDP2's data refill: between a forward and its backward the
    weight does not change, so every re-gather writes back the value that was saved."""
    local = out._local_tensor if hasattr(out, "_local_tensor") else out
    if getattr(local, "_scale", None) is None:
        raise RuntimeError(
            f"float8kit: FSDP2 passed out={type(local).__name__}, expected the float8 "
            "weight built by the first all-gather"
        )
    with torch.autograd._unsafe_preserve_version_counter(local._scale):
        local._scale.copy_(scale)


def _mesh_rank(mesh) -> int:
    """This rank's index in the 1-D shard ``mesh`` (0 on one rank)."""
    return 0 if mesh.size() == 1 else mesh.get_local_rank()


# ---------------------------------------------------------------------------- scales


@dataclass
class PrecomputedScale:
    """A weight's next all-gather scale from ``precompute_scales``, stored on its module.

    Valid while the module's weight parameter is the same object at the same version as
    when its amax was read: both change alike on every rank (see the module docstring).

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
    local_amax: torch.Tensor
    gathered_amax: torch.Tensor | None = None

    def fresh(self, param: torch.Tensor) -> bool:
        return self.param() is param and param._version == self.version


def weight_scale_for_all_gather(
    weight: Float8AllGatherWeight, mesh, module: nn.Module, where: ShardSpec
) -> torch.Tensor:
    """The full weight's scale for this step's all-gather, identical on every rank of
    ``mesh`` (``where``: the shard's place in the full weight; the shard is cast with its
    part of it, ``Format.shard_scale``).

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
    config = weight._config
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
            if precomputed.fresh(module.weight):
                precomputed.gathered_amax = groups.group_amaxes(weight._tensor, where)
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
        amax = groups.group_amaxes(weight._tensor, where)
        if kind is ScalingType.DYNAMIC or not scale_set:
            # the scale needs the whole weight's amax: over every mesh dim it is sharded on
            amax = _all_reduce_max(amax, amax_group(module, mesh))
    return casting.operand_scale(
        cast, GemmRole.WEIGHT, config, amax, state_scale, amax_record, scale_set
    )


def _all_reduce_max(amax: torch.Tensor, group) -> torch.Tensor:
    """The max of ``amax`` over the ranks of ``group``: one all-reduce (none on one rank)."""
    amax = amax.clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


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


def shard_spec(shard_shape: torch.Size, outer_size: torch.Size, mesh, module) -> ShardSpec:
    """Where this rank's shard of ``module.weight`` sits (``ShardSpec``), from FSDP2's shard
    ``mesh`` and outer size and the weight's DTensor placements (tensor parallel / HSDP
    dims); remembers ``mesh`` on ``module`` for ``precompute_scales``."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    module.fp8_state.shard_mesh = mesh
    rank, world = _mesh_rank(mesh), mesh.size()
    weight = module.weight
    if not isinstance(weight, DTensor) or weight.device_mesh.ndim == 1:
        return ShardSpec.of(shard_shape, outer_size, rank, world)
    spmd = weight.device_mesh
    fsdp_dim = _fsdp_mesh_dim(spmd, mesh)
    # the outer weight: the DTensor with FSDP2's dim replicated (the TP shard, or all of it)
    placements = [Replicate() if i == fsdp_dim else p for i, p in enumerate(weight.placements)]
    outer_shape, outer_offset = compute_local_shape_and_global_offset(
        weight.shape, spmd, placements
    )
    if tuple(outer_shape) != tuple(outer_size):
        raise ValueError(
            f"float8kit: float8 all-gather weight ({module.extra_repr()}) on mesh {spmd}: "
            f"FSDP2's unsharded size {tuple(outer_size)} is not the weight's shard "
            f"{tuple(outer_shape)} on the mesh dims other than FSDP2's shard dim"
        )
    coord = spmd.get_coordinate()
    others = [d for d in range(spmd.ndim) if d != fsdp_dim]
    slot, n_slots = 0, 1
    for d in others:
        slot, n_slots = slot * spmd.size(d) + coord[d], n_slots * spmd.size(d)
    return ShardSpec.of(
        shard_shape,
        outer_size,
        rank,
        world,
        full_shape=torch.Size(weight.shape),
        outer_offset=tuple(outer_offset),
        slot=slot,
        n_slots=n_slots,
    )


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
    shard = weight._local_tensor._tensor
    spmd = weight.device_mesh
    if spmd.ndim == 1:
        outer = weight.shape
    else:  # the outer size is the global one with the non-FSDP dims' sharding applied
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        d = _fsdp_mesh_dim(spmd, mesh)
        placements = [Replicate() if i == d else p for i, p in enumerate(weight.placements)]
        outer, _ = compute_local_shape_and_global_offset(weight.shape, spmd, placements)
    return shard_spec(shard.shape, torch.Size(outer), mesh, m)


def _group_amaxes(m: nn.Module, where: ShardSpec) -> torch.Tensor:
    """The group amaxes of ``m``'s local weight shard in the full weight's scale shape."""
    shard = m.weight._local_tensor._tensor
    return formats.weight(m.config.cast_config_weight).group_amaxes(shard, where)


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

    One contribution for all of them: the local shards' group amaxes (tensorwise weights:
    one each, in one batched pass; rowwise: one per row of the full weight, 0 for the rows
    other ranks own, see ``float8kit.formats``), and an ``apply`` that turns the all-reduced
    amaxes into next-step scales (tensorwise: batched per cast) and stores each on its
    module, stamped with the weight version it was read at.

    Args:
        module: the (FSDP2-wrapped) model.

    Returns:
        ``[(amaxes, apply)]``, or ``[]`` when nothing is sharded with float8 all-gather.
    """
    sharded = _sharded_fp8_linears(module)
    if not sharded:
        return []
    _report_stale_weights(sharded)
    # Tensorwise weights: group by scale computation (cast, power-of-2 rounding) and order
    # the weights group by group, so each group is one slice of the amaxes: no index tensor
    # to copy to the device. Rowwise weights follow, one slice per weight. A blockwise
    # weight's scales are local to its shard: nothing to reduce.
    groups: dict[tuple, list[nn.Module]] = {}
    others: list[tuple[nn.Module, ShardSpec]] = []
    fp4: list[tuple] = []  # NVFP4 weights: fsdp_nvfp4.contribution
    for _, m in sharded:
        cast = m.config.cast_config_weight
        if cast.scaling_type is not ScalingType.DYNAMIC or cast.is_mx:
            continue  # MX: every scale is made in the hook (see fsdp_mx)
        where = _precompute_spec(m)
        if where is None:
            continue
        if cast.is_nvfp4:
            if where.n_slots == 1:  # (the hook refuses multi-dim meshes)
                start = where.offset if where.dim == 0 else 0
                fp4.append((m, m.weight._local_tensor._tensor, start, where.outer_shape))
            continue
        mesh = m.fp8_state.shard_mesh or m.weight.device_mesh
        gran = formats.weight(cast)
        if gran.block is not None and not gran.cuts(where.outer_shape[0], mesh.size()):
            continue  # whole blocks on every shard: each rank's block scales are its own
        if gran is formats.TENSORWISE:
            groups.setdefault((cast, m.config.round_scales_to_power_of_2), []).append(m)
        else:
            others.append((m, where))
    extra = [fsdp_nvfp4.contribution(fp4)] if fp4 else []
    if not groups and not others:
        return extra
    mods = [m for rows in groups.values() for m in rows] + [m for m, _ in others]
    n_tensorwise = len(mods) - len(others)
    tensorwise = [m.weight._local_tensor._tensor for m in mods[:n_tensorwise]]
    pieces = [scaling.local_amaxes(tensorwise)] if tensorwise else []
    group_amaxes = [_group_amaxes(m, where) for m, where in others]
    amaxes = torch.cat(pieces + [g.reshape(-1) for g in group_amaxes])
    stamps = [(weakref.ref(m.weight), m.weight._version) for m in mods]

    def apply(reduced: torch.Tensor) -> None:
        start = 0
        for (cast, _), rows in groups.items():
            stop = start + len(rows)
            scales = casting.operand_scale(
                cast, GemmRole.WEIGHT, rows[0].config, reduced[start:stop]
            )
            for i, scale in zip(range(start, stop), scales.unbind(0), strict=True):
                mods[i].fp8_state.all_gather_scale = PrecomputedScale(scale, *stamps[i], amaxes[i])
            start = stop
        for i, local in enumerate(group_amaxes, start=n_tensorwise):
            m, stop = mods[i], start + local.numel()
            full = reduced[start:stop].reshape(local.shape)
            scale = casting.operand_scale(
                m.config.cast_config_weight, GemmRole.WEIGHT, m.config, full
            )
            m.fp8_state.all_gather_scale = PrecomputedScale(scale, *stamps[i], local)
            start = stop

    return [(amaxes, apply), *extra]


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


linear.register_fsdp_weight_wrapper(wrap_weight)
linear.register_fsdp_mx_copy(fsdp_mx.gather_copy)
