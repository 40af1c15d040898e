"""FSDP2 float8 all-gather of MX weights: one copy per pass, the one that pass's gemm needs.

An MX block is not its own transpose: the output gemm needs the (N, K) weight in 32-element
blocks along K (``MX(dim=1)``), the grad_input gemm along N (``MX(dim=0)``). So the hook
gathers the copy of the pass it runs in, never both:

- forward (and any all-gather outside backward): each rank casts its rows along K. A block
  lies within one row, and FSDP2 shards whole rows (dim 0), so each shard casts alone.
- backward (FSDP2's re-gather after ``reshard_after_forward``; told by the autograd engine
  running: ``torch._C._current_graph_task_id() != -1``): each rank casts its rows along N.
  A block is 32 rows; where a shard boundary falls inside one (``cut_blocks``), the block's
  scale byte is the MAX of both sides' partial bytes: one all-reduce of those blocks' bytes
  only (K bytes each). The shard is then cast by ``to_mx`` itself with a value of that byte
  planted in a padding row (``_value_of_byte``), so every byte is the one-device cast's.

The fp8 bytes ride FSDP2's all-gather (1 byte per element). The e8m0 scale bytes (1 per 32
elements) take one all-gather of their own, in the hook, and reach the post hook as
metadata: FSDP2 requires every all-gather input of an unevenly sharded parameter to
have the padded shard's size, which a scale is not.

The gathered weight is one ``Float8TrainingTensor`` object for the whole run (FSDP2's
``out``): a re-gather refills its data bytes and gives it the pass's granularity and scale,
so the tensor that forward saved for backward holds the along-N copy when backward reads
it.

A pass without an FSDP2 all-gather of its own gathers its copy itself (``gather_copy``,
which ``float8kit.linear`` calls; the hook notes each module's shard): the backward after a
forward that did not reshard (``reshard_after_forward=False``, and the root module, which
FSDP2 does not reshard after forward by default) gathers the along-N copy in the
grad_input gemm, the same bytes as a re-gather (FSDP2 keeps the along-K copy until the
backward ends, so the along-N one lives beside it for the gemm); a forward recomputed in
backward by activation checkpointing, after FSDP2's along-N re-gather, gathers the along-K
copy for its output gemm (that backward moves both copies). Re-casting the copy at hand
instead would not be the cast of the hp weight: a float8 MX weight with no shards behind
it is refused. Not supported: tensor-parallel / HSDP meshes (refused), torch.compile of
the MX all-gather (the pass's copy is chosen in Python, per call). Internal.
"""

from __future__ import annotations

import dataclasses
import math
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from float8kit import cast as casting
from float8kit import scaling, versions
from float8kit.config import MX_BLOCK, Float8LinearConfig, GemmRole
from float8kit.formats import MX, ShardSpec
from float8kit.tensor import Float8TrainingTensor, local


def in_backward() -> bool:
    """Whether the autograd engine is running (FSDP2's pre-backward re-gather, its backward
    prefetch) rather than a forward."""
    return torch._C._current_graph_task_id() != -1


def cut_blocks(rows: int, world: int) -> list[int]:
    """The 32-row blocks of a ``rows``-row weight that FSDP2's dim-0 shards over ``world``
    ranks cut (a shard boundary inside the block), in order; alike on every rank."""
    chunk = math.ceil(rows / world)
    return sorted(
        {
            j * chunk // MX_BLOCK
            for j in range(1, world)
            if j * chunk < rows and j * chunk % MX_BLOCK
        }
    )


def pre_all_gather(
    module: nn.Module,
    shard: torch.Tensor,
    config: Float8LinearConfig,
    outer_size: torch.Size,
    world: int,
    group,
    where: ShardSpec,
):
    """``fsdp_pre_all_gather`` for an MX weight: this pass's copy of the shard.

    Returns ``((data_uint8,), (scale, dim, rows))``: the shard's fp8 bytes padded to FSDP2's
    padded shard size, and the gathered weight's whole e8m0 scale (already all-gathered),
    the dim its blocks run along (1 forward, 0 backward) and the weight's row count. Notes
    where ``module``'s shard is, for ``gather_copy``."""
    if where.n_slots != 1 or tuple(where.full_shape) != tuple(outer_size):
        raise ValueError(
            "float8kit: an MX float8 all-gather weight on a multi-dim mesh (tensor parallel, "
            "HSDP) is not supported: shard it with FSDP2 on a 1-D mesh, or set "
            "enable_fsdp_float8_all_gather=False"
        )
    source = _Source(weakref.ref(shard), config, outer_size, world, group, where)
    _SOURCES[module] = source
    return source.cast(0 if in_backward() else 1)


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where a module's MX weight shard is: enough to cast and gather either copy."""

    shard: weakref.ref
    config: Float8LinearConfig
    outer_size: torch.Size
    world: int
    group: object
    where: ShardSpec

    def cast(self, dim: int):
        """The shard's copy blocked along ``dim`` as ``pre_all_gather`` returns it."""
        shard, config, world, group = self.shard(), self.config, self.world, self.group
        cast = _cast_for(config, dim)
        fp8_dtype = cast.dtype_for(GemmRole.WEIGHT)
        n = self.outer_size[0]
        chunk = math.ceil(n / world)
        start = min(self.where.offset if self.where.dim == 0 else 0, n)
        rows = shard.shape[0]
        if dim == 1:
            data, scale = casting.to_mx(shard, 1, fp8_dtype, cast.mx_scale_rounding)
            scale = _gather_rows(_pad_rows(scale, chunk), world, group)[:n]
        else:
            data, local_scale = _cast_along_rows(shard, start, n, world, group, fp8_dtype, cast)
            scale = _gather_block_scales(local_scale, start, rows, n, world, group)
        data = _pad_rows(data.contiguous().view(torch.uint8), chunk)
        return (data,), (scale, dim, n)


# module -> _Source of its weight's last FSDP2 all-gather
_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# FSDP2's unsharded weight parameter -> its module (found once, in _SOURCES)
_MODULE_OF = WeakIdKeyDictionary()


def gather_copy(weight: torch.Tensor, dim: int) -> Float8TrainingTensor | None:
    """The MX copy blocked along ``dim`` of the FSDP2 float8 all-gather weight ``weight``
    (FSDP2's unsharded parameter, which holds the other copy), cast from the shards and
    all-gathered now, bitwise the copy the hook would gather; None when ``weight`` is no
    such parameter.

    For a pass without its own FSDP2 all-gather: a backward after a forward that did not
    reshard (``reshard_after_forward=False``, FSDP2's root), which needs the along-N copy;
    a forward recomputed in backward (activation checkpointing) after FSDP2's re-gather,
    which needs the along-K one. Every rank runs the same layers' gemms in the same order,
    so every rank calls this alike."""
    module = _MODULE_OF.get(weight)
    if module is None:
        module = next((m for m in list(_SOURCES) if m.weight is weight), None)
        if module is None:
            return None
        _MODULE_OF[weight] = module
    source = _SOURCES[module]
    if source.shard() is None:  # FSDP2 replaced the shard since: no all-gather since
        return None
    (data,), (scale, _, rows) = source.cast(dim)
    data = _gather_rows(data, source.world, source.group)[:rows]
    fp8 = data.view(_cast_for(source.config, dim).dtype_for(GemmRole.WEIGHT))
    hp_dtype = local(weight)._orig_dtype
    return Float8TrainingTensor(fp8, scale, hp_dtype, GemmRole.WEIGHT, MX(dim), source.config)


def post_all_gather(
    all_gather_outputs, metadata, param_dtype: torch.dtype, config: Float8LinearConfig, out
):
    """``fsdp_post_all_gather`` for an MX weight: the gathered copy as a
    ``Float8TrainingTensor`` (first time: ``(weight, (data,))``), or, on a re-gather, ``out``
    turned into this pass's copy in place (its data already views the refilled buffer)."""
    (data,), (scale, dim, rows) = all_gather_outputs, metadata
    gran = MX(dim)
    if out is not None:
        local = out._local_tensor if hasattr(out, "_local_tensor") else out
        if not isinstance(local, Float8TrainingTensor):
            raise RuntimeError(
                f"float8kit: FSDP2 passed out={type(local).__name__}, expected the MX float8 "
                "weight built by the first all-gather"
            )
        local._gran, local._scale = gran, scale
        return None
    fp8 = data[:rows].view(_cast_for(config, dim).dtype_for(GemmRole.WEIGHT))
    weight = Float8TrainingTensor(fp8, scale, param_dtype, GemmRole.WEIGHT, gran, config)
    return weight, (data,)


# ---------------------------------------------------------------------------- helpers


def _cast_for(config: Float8LinearConfig, dim: int):
    """The cast of the copy blocked along ``dim``: the output gemm's (1) or grad_input's (0)."""
    return config.cast_config_weight_for_grad_input if dim == 0 else config.cast_config_weight


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    padded = t.new_zeros((rows, *t.shape[1:]))
    padded[: t.shape[0]].copy_(t)
    return padded


def _gather_rows(t: torch.Tensor, world: int, group) -> torch.Tensor:
    """Every rank's ``t`` (same shape everywhere) stacked along dim 0: one all-gather."""
    if world == 1:
        return t
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    getattr(dist, versions.ALL_GATHER_SINGLE)(out, t.contiguous(), group=group)
    return out


def _cast_along_rows(shard, start, n, world, group, fp8_dtype, cast):
    """The shard's rows cast in 32-row blocks of the full (n-row) weight: ``(data, scale)``
    with ``scale`` the bytes of the blocks the shard touches (block ``start // 32`` on).

    The shard is cast by ``to_mx`` itself, padded to whole blocks of the full weight with
    zero rows (which change no amax). A block cut by a shard boundary gets its whole-block
    scale byte: the byte is monotone in the amax, so it is the MAX over ranks of each part's
    byte (one all-reduce of the cut blocks' bytes, a NaN's 255 included), and a padding row
    of the block (one exists: part of the block lies outside the shard) carries a value of
    that byte (``_value_of_byte``) into ``to_mx``."""
    rows = shard.shape[0]
    top = start % MX_BLOCK
    bottom = -(start + rows) % MX_BLOCK
    padded = shard.new_zeros((top + rows + bottom, shard.shape[1]))
    padded[top : top + rows] = shard
    cut = cut_blocks(n, world)
    if cut:
        first, rounding = start // MX_BLOCK, cast.mx_scale_rounding
        local = scaling.mx_block_amax(padded, 0)
        touched = [(i, b - first) for i, b in enumerate(cut) if 0 <= b - first < local.shape[0]]
        parts = shard.new_zeros((len(cut), shard.shape[1]), dtype=torch.uint8)
        for i, j in touched:
            parts[i] = scaling.mx_scale_bits(local[j], fp8_dtype, rounding)
        if world > 1:
            dist.all_reduce(parts, op=dist.ReduceOp.MAX, group=group)
        fp8_max, big = scaling.fp8_max(fp8_dtype), torch.finfo(shard.dtype).max
        for i, j in touched:
            row = j * MX_BLOCK if j * MX_BLOCK < top else (j + 1) * MX_BLOCK - 1
            padded[row] = _value_of_byte(parts[i], fp8_max, big, rounding).to(shard.dtype)
    data, scale = casting.to_mx(padded, 0, fp8_dtype, cast.mx_scale_rounding)
    return data[top : top + rows], scale


def _value_of_byte(byte: torch.Tensor, fp8_max: float, big: float, rounding: str):
    """An fp32 amax whose e8m0 byte (``scaling.mx_scale_bits`` with ``rounding``) is
    ``byte``, within ``big`` (the hp dtype's max) where finite: ``fp8_max * 2 ** (byte -
    127)`` (255: NaN). Beyond fp32's range that is inf: with "floor" (the byte keeps the
    amax's exponent) only an inf amax has such a byte; with "rceil" 254 is an inf amax's,
    and the largest finite amaxes round up to a byte whose value is beyond the dtype: the
    dtype's max has that byte."""
    value = scaling.mx_descale(byte) * fp8_max
    if rounding == "floor":
        return value
    value = torch.clamp(value, max=big)  # keeps NaN
    return torch.where(byte == 254, math.inf, value)


def _gather_block_scales(local_scale, start, rows, n, world, group):
    """The full weight's (ceil(n / 32), K) scale from each rank's block scales: each rank
    sends the blocks that start in its rows (padded to ceil(chunk / 32)), one all-gather."""
    chunk = math.ceil(n / world)
    per_rank = math.ceil(chunk / MX_BLOCK)
    skip = math.ceil(start / MX_BLOCK) - start // MX_BLOCK  # a first block begun before
    own = local_scale[skip:] if rows else local_scale[:0]
    gathered = _gather_rows(_pad_rows(own, per_rank), world, group)
    # block b comes from the rank holding its first row, r, which sent it as its
    # (b - ceil(r * chunk / 32))-th (index arithmetic on the device: no host copy)
    b = torch.arange(math.ceil(n / MX_BLOCK), device=gathered.device)
    r = b * MX_BLOCK // chunk
    return gathered[r * per_rank + b + (-(r * chunk)).div(MX_BLOCK, rounding_mode="floor")]
