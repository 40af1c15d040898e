"""FSDP2 float8 all-gather of NVFP4 weights: the weight's one NVFP4 copy (16x16 blocks, which
serve the output and the grad_input gemm alike), gathered as e2m1 codes.

Each rank casts its rows of the weight with the *whole* weight's scales, so the gathered
weight is bitwise the one-device cast (``nvfp4.quantize(w, (16, 16))``):

- The scales need every 16x16 block's amax and the tensor's amax (the max of the blocks'):
  each rank takes the amaxes of the blocks its rows touch (a block cut by a shard boundary
  gets a partial amax from each side), and one all-reduce(MAX) of the block-amax grid (with
  a NaN flag per block: MAX is not defined on NaN) gives every rank the full grid. The
  block amaxes join ``precompute_scales``' one all-reduce after the optimizer step (the
  ``contribution``), and the hooks of the next step use the scales it keeps; without a fresh
  one (the first step, no ``precompute_scales``) the hook all-reduces itself. A scale is
  fresh while the weight is the same parameter at the same version (alike on every rank),
  so the backward's re-gather reuses the forward's.
- The shard's codes: its elements times their block's factor ``(1 / tensor_scale) /
  block_scale``, rounded to nearest: the products the one-device cast forms.

What travels: the codes packed two per byte (0.5 byte per element, a quarter of bf16's)
when FSDP2's shards are even (the weight's rows a multiple of the world size). On uneven
shards FSDP2 requires every all-gather input to have the padded shard's *shape*, which
packed rows do not: the codes then travel one per byte (half of bf16's). The scale grid
(one fp32 pair per 256 elements, the same on every rank after the all-reduce) reaches the
post hook as metadata. An odd in_features cannot be packed: refused at the first gather.

The gathered weight is one ``Float8TrainingTensor`` for the whole run (FSDP2's ``out``): a
re-gather refills its codes (unpacked in place from the refilled buffer) and its scale.
Not supported: tensor-parallel / HSDP meshes (refused). Internal.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist
from torch import nn

from float8kit import scaling
from float8kit.config import NVFP4_BLOCK, Float8LinearConfig, GemmRole
from float8kit.formats import NVFP4, ShardSpec, nvfp4
from float8kit.tensor import Float8TrainingTensor

WEIGHT = NVFP4(NVFP4_BLOCK, NVFP4_BLOCK)

# module -> (weakref to its weight parameter, that parameter's version, the scale)
_SCALES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def packs(rows: int, world: int) -> bool:
    """Whether the codes travel packed: FSDP2's dim-0 shards of ``rows`` rows are even."""
    return rows % world == 0


def pre_all_gather(
    module: nn.Module,
    shard: torch.Tensor,
    outer_size: torch.Size,
    world: int,
    group,
    where: ShardSpec,
):
    """``fsdp_pre_all_gather`` for an NVFP4 weight: ``((codes,), (scale, rows, packed))``,
    the shard's e2m1 codes (packed two per byte if ``packs``) padded to FSDP2's padded shard
    rows, and the whole weight's scale (2, ceil(N / 16), ceil(K / 16))."""
    if where.n_slots != 1 or tuple(where.full_shape) != tuple(outer_size):
        raise ValueError(
            "float8kit: an NVFP4 float8 all-gather weight on a multi-dim mesh (tensor "
            "parallel, HSDP) is not supported: shard it with FSDP2 on a 1-D mesh, or set "
            "enable_fsdp_float8_all_gather=False"
        )
    n, k = outer_size
    packed = packs(n, world)
    if packed and k % 2:
        raise ValueError(
            f"float8kit: {type(module).__name__}({module.extra_repr()}): an NVFP4 float8 "
            f"all-gather packs two e2m1 codes per byte along in_features, which must be even "
            f"(here {k}); keep this layer in hp (the default module filter does)"
        )
    start = min(where.offset if where.dim == 0 else 0, n)
    scale = _whole_weight_scale(module, shard, start, outer_size, world, group)
    codes = _cast_rows(shard, start, scale)
    if packed:
        codes = nvfp4.pack(codes)
    chunk = math.ceil(n / world)
    if codes.shape[0] != chunk:  # uneven or empty shard: FSDP2's padded shard size
        codes = torch.nn.functional.pad(codes, (0, 0, 0, chunk - codes.shape[0]))
    return (codes,), (scale, n, packed)


def post_all_gather(
    all_gather_outputs, metadata, param_dtype: torch.dtype, config: Float8LinearConfig, out
):
    """``fsdp_post_all_gather`` for an NVFP4 weight: the gathered (N, K) codes as the
    ``Float8TrainingTensor`` the gemms use (first time: ``(weight, tensors to free)``), or,
    on a re-gather, ``out`` refilled in place: its codes and its scale."""
    (data,), (scale, rows, packed) = all_gather_outputs, metadata
    if out is not None:
        local = out._local_tensor if hasattr(out, "_local_tensor") else out
        if not isinstance(local, Float8TrainingTensor):
            raise RuntimeError(
                f"float8kit: FSDP2 passed out={type(local).__name__}, expected the NVFP4 "
                "weight built by the first all-gather"
            )
        # in place without a version bump, as FSDP2 refills its buffers: autograd saved this
        # weight in forward, and the backward re-gather writes back the same values
        with torch.autograd._unsafe_preserve_version_counter(local._scale):
            local._scale.copy_(scale)
        if packed:
            with torch.autograd._unsafe_preserve_version_counter(local._data):
                local._data.copy_(_unpack(data[:rows]))
        return None
    codes = _unpack(data[:rows]) if packed else data[:rows]
    weight = Float8TrainingTensor(
        codes, scale.clone(), param_dtype, GemmRole.WEIGHT, WEIGHT, config
    )
    # FSDP2 frees these after the pass and re-allocates them before the next gather
    return weight, ((data, codes) if packed else (data,))


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """Codes two per byte (``nvfp4.pack``) back to one per byte."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def _cast_rows(shard: torch.Tensor, start: int, scale: torch.Tensor) -> torch.Tensor:
    """The codes of weight rows ``start:start + len(shard)`` cast with the whole weight's
    ``scale``: per element the fp32 product the one-device cast forms, rounded to nearest."""
    factor = (1.0 / scale[1]) / scale[0]  # per 16x16 block, as nvfp4.quantize
    rows = (torch.arange(shard.shape[0], device=shard.device) + start) // NVFP4_BLOCK
    per_element = factor[rows].repeat_interleave(NVFP4_BLOCK, dim=1)[:, : shard.shape[1]]
    return nvfp4.round_nearest(
        torch.clamp(shard.to(torch.float32) * per_element, -nvfp4.E2M1_MAX, nvfp4.E2M1_MAX)
    )


def _whole_weight_scale(module, shard, start, outer_size, world, group) -> torch.Tensor:
    """The whole weight's NVFP4 scale: the one ``precompute_scales`` or the forward made
    while the weight is unchanged (the same parameter at the same version: alike on every
    rank), else from one all-reduce of the block amaxes, now."""
    kept = _SCALES.get(module)
    if kept is not None and kept[0]() is module.weight and kept[1] == module.weight._version:
        return kept[2]
    partial = _partial_amaxes(shard, start, outer_size)
    if world > 1:
        dist.all_reduce(partial, op=dist.ReduceOp.MAX, group=group)
    return _keep_scale(module, partial, (weakref.ref(module.weight), module.weight._version))


def contribution(mods: list[tuple[nn.Module, torch.Tensor, int, torch.Size]]):
    """``precompute_scales``' part for NVFP4 float8 all-gather weights (``(module, local
    shard, its first row, outer size)`` each): their partial block amaxes, in its one
    all-reduce, and an ``apply`` that keeps each weight's next scale for its hook (stamped
    with the weight's version now, after the optimizer step)."""
    parts = [_partial_amaxes(shard, start, outer) for _, shard, start, outer in mods]
    stamps = [(weakref.ref(m.weight), m.weight._version) for m, *_ in mods]

    def apply(reduced: torch.Tensor) -> None:
        at = 0
        for (m, *_), part, stamp in zip(mods, parts, stamps, strict=True):
            _keep_scale(m, reduced[at : at + part.numel()].reshape(part.shape), stamp)
            at += part.numel()

    return torch.cat([p.reshape(-1) for p in parts]), apply


def _keep_scale(module: nn.Module, reduced: torch.Tensor, stamp) -> torch.Tensor:
    """The whole weight's scale from its all-reduced ``_partial_amaxes``, kept for the hook."""
    grid = torch.where(reduced[1] > 0, math.nan, reduced[0])
    tensor = nvfp4.tensor_scale(scaling.amax(grid))  # NaN propagates, as one device's
    blocks = nvfp4.block_scale(grid, tensor)
    scale = torch.stack([blocks, tensor.expand_as(blocks)])
    _SCALES[module] = (*stamp, scale)
    return scale


def _partial_amaxes(shard: torch.Tensor, start: int, outer_size: torch.Size) -> torch.Tensor:
    """(2, ceil(N / 16), ceil(K / 16)): this shard's block amaxes (NaN as inf: MAX is not
    defined on NaN) and a flag per block where a NaN is; all-reduce(MAX) makes them the whole
    weight's."""
    grid = _block_amaxes(shard, start, outer_size)
    return torch.stack([scaling.nan_to_inf(grid), grid.isnan().to(torch.float32)])


def _block_amaxes(shard: torch.Tensor, start: int, outer_size: torch.Size) -> torch.Tensor:
    """The (ceil(N / 16), ceil(K / 16)) 16x16 block amaxes over this shard's rows (0 for the
    blocks it does not touch; NaN where a NaN is)."""
    n, k = outer_size
    b = NVFP4_BLOCK
    grid = shard.new_zeros((-(-n // b), -(-k // b)), dtype=torch.float32)
    rows = shard.shape[0]
    if rows == 0:
        return grid
    top = start % b
    padded = torch.nn.functional.pad(shard, (0, 0, top, 0))  # to the block boundary above
    part = scaling.block_amax(padded, (b, b))
    grid[start // b : start // b + part.shape[0]] = part
    return grid
