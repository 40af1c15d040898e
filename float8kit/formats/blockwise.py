"""Blockwise (DeepSeek-V3): one float8 scale per ``rows`` x ``cols`` block of 2-D data, shape
(ceil(R / rows), ceil(C / cols)): 1x128 / 128x1 activation tiles, 128x128 weight blocks."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from float8kit import scaling
from float8kit.config import GemmRole, ScalingType
from float8kit.formats.base import (
    LOCAL_BLOCKS,
    Capabilities,
    Float8Elements,
    Format,
    GroupScaledGather,
    WholeBlocks,
    local_scale_inputs,
    local_scale_outputs,
    to_fp8_saturated,
)
from float8kit.formats.layout import CUDA_ALIGN, GEMM_DIMS


@dataclasses.dataclass(frozen=True)
class Blockwise(WholeBlocks, GroupScaledGather, Float8Elements, Format):
    capabilities = Capabilities(
        scaling_types=(ScalingType.DYNAMIC,),
        fsdp_float8_all_gather=True,
        tensor_parallel=LOCAL_BLOCKS,
        experts=False,
        ep_dispatch=False,
        layer_multiple=None,
        min_cuda_capability=(9, 0),
        gemm="block",
    )
    _named = "a blockwise"

    # the (rows, cols) of a scale block of 2-D data
    rows: int
    cols: int

    @property
    def block(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @classmethod
    def for_operand(cls, cast, role, reduce_dim, ndim):
        # weights in square blocks (which serve both of their gemms), activations in
        # 1 x block_size tiles along the reduced dim (block_size x 1 when that is dim 0)
        b = cast.granularity_options.block_size
        if role is GemmRole.WEIGHT:
            return cls(b, b)
        return cls(1, b) if reduce_dim in (1, -1) else cls(b, 1)

    @classmethod
    def filter_multiple(cls, cast):
        # the block-scaled kernel tiles both dims of the weight in whole blocks
        return math.lcm(16, cast.granularity_options.block_size)

    def short(self) -> str:
        return f"blockwise({self.rows}x{self.cols})"

    def quantize(self, hp, scale, fp8_dtype, guard):
        return to_fp8_blocks(hp, scale, self.block, fp8_dtype, guard_non_finite=guard), scale

    def emulated_mm(self, a, b):
        """``a @ b`` of two blockwise training tensors: the kernel's definition in fp32."""
        inv_a = scaling.inverse(a._scale)
        inv_b = scaling.inverse(b._scale)
        return emulated_block_mm(a._data, b._data, inv_a, inv_b, a._gran.block, b._gran.block)

    def amax(self, hp):
        return scaling.block_amax(hp, self.block)

    def expand(self, scale, shape):
        return scaling.expand_block_scale(scale, self.block, shape)

    # One scale per block of the outer weight (the blocks a single device casts it in).
    # Where FSDP2's dim-0 shards cut blocks (``cuts``), a block that straddles shards gets the
    # max of their partial amaxes, so every shard is cast with the whole block's scale and
    # the gathered weight is bitwise the one-device cast (shards of whole blocks need no amax
    # collective: fsdp.py casts them alone). The full scale is (n_slots, ceil(R / b),
    # ceil(C / b)) for the global shape: one block grid per slot (TP shard, HSDP replica).
    def group_amaxes(self, shard, where):
        b = self.rows
        grid = (where.n_slots, -(-where.full_shape[0] // b), -(-where.full_shape[1] // b))
        full = torch.zeros(grid, dtype=torch.float32, device=shard.device)
        if shard.numel() == 0:
            return full
        start = where.offset if where.dim == 0 else 0
        amax = scaling.row_block_amax(shard, b, start)
        first = start // b
        full[where.slot, first : first + amax.shape[0], : amax.shape[1]] = amax
        return full

    def shard_scale(self, scale, shard, where):
        start = where.offset if where.dim == 0 else 0
        rows = torch.arange(start, start + shard.shape[0], device=scale.device) // self.rows
        grid = self.gathered_scale(scale, where)
        return grid[rows].repeat_interleave(self.cols, dim=1)[:, : shard.shape[1]]

    def gathered_scale(self, scale, where):
        r, c = where.outer_shape
        return scale[where.slot, : -(-r // self.rows), : -(-c // self.cols)]

    def cuts(self, outer_rows, world):
        return world > 1 and math.ceil(outer_rows / world) % self.rows != 0

    # FSDP2 all-gather: where the shards cut blocks, the scales of the full weight's blocks
    # (GroupScaledGather; the gathered weight's row count rides along to drop the padding);
    # on shards of whole blocks each shard is cast alone and its block scales are gathered
    # with its bytes (``local_scale_inputs``).
    def all_gather_inputs(self, job):
        if self.cuts(job.outer_size[0], job.world):
            return super().all_gather_inputs(job)
        data, scale = job.cast_own()
        return local_scale_inputs(data, scale, job.padded_rows, self.rows, job.world)

    def _rows_metadata(self, job):
        return (job.outer_size[0],)

    def _gathered_rows(self, data, scale, rows):
        return data[:rows]

    def all_gathered(self, outputs, metadata, config):
        if len(outputs) == 1 and len(metadata) > 1:  # shards that cut blocks
            return super().all_gathered(outputs, metadata, config)
        fp8_dtype = config.cast_config_weight.dtype_for(GemmRole.WEIGHT)
        data, scale, free = local_scale_outputs(outputs, metadata, fp8_dtype, None)
        return data, scale, self, free

    def refill(self, weight, outputs, metadata):
        if len(outputs) == 1 and len(metadata) > 1:
            return super().refill(weight, outputs, metadata)
        local_scale_outputs(outputs, metadata, None, weight)

    def precomputes(self, where, world):
        # whole blocks on every shard: each rank's block scales are its own
        return self.cuts(where.outer_shape[0], world)


def to_fp8_blocks(
    hp: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    fp8_dtype: torch.dtype,
    *,
    guard_non_finite: bool = True,
) -> torch.Tensor:
    """``to_fp8_saturated`` of a 2-D ``hp`` with one scale per ``block`` (``scale`` has
    ``block_amax``'s shape). Same shape as ``hp``, contiguous."""
    r, c = hp.shape
    blocked = scaling.blocked(hp, block)
    data = to_fp8_saturated(
        blocked, scale[:, None, :, None], fp8_dtype, guard_non_finite=guard_non_finite
    )
    data = data.reshape(blocked.shape[0] * blocked.shape[1], -1)
    if data.shape != (r, c):
        data = data[:r, :c].contiguous()
    return data


# ---------------------------------------------------------------------------- gemm plan


@dataclasses.dataclass(frozen=True)
class BlockKernelPlan:
    """How the CUDA block-scaled gemm runs one (M, K) @ (K, N) gemm: zero rows appended to
    the left operand (``pad_m``: its scales are M-major, and cuBLAS wants their columns
    16-byte aligned), zeros appended to the inner dim (``pad_k``: whole 128-blocks), the
    scaling types of both operands (``torch.nn.functional.ScalingType`` member names)."""

    pad_m: int
    pad_k: int
    recipe_a: str
    recipe_b: str


def block_kernel_plan(
    m: int,
    k: int,
    n: int,
    block_a: tuple[int, int],
    block_b: tuple[int, int],
    gemm: str | None = None,
) -> BlockKernelPlan:
    """Padding and scaling types of a block-scaled CUDA gemm; raises when the kernel cannot
    run it. The kernel takes a left operand in 1x128 tiles and a right one in 128x128
    blocks or 128x1 tiles (per column), N a multiple of 128 for 128x128 blocks, of 16
    otherwise. A partial last block of K (a token count in the grad_weight gemm) is padded."""
    bk = 128
    where = f" in the {gemm} gemm" if gemm else ""
    if block_a != (1, bk) or block_b not in ((bk, bk), (bk, 1)):
        raise ValueError(
            f"block-scaled float8 gemm on CUDA needs a left operand in 1x{bk} tiles and a "
            f"right one in {bk}x{bk} blocks or {bk}x1 tiles; got {block_a[0]}x{block_a[1]} "
            f"and {block_b[0]}x{block_b[1]}{where}: use BlockwiseGranularity(block_size={bk})"
        )
    n_align = bk if block_b == (bk, bk) else CUDA_ALIGN
    if n % n_align:
        _, out_name = GEMM_DIMS.get(gemm, ("", "the output dim N"))
        raise ValueError(
            f"block-scaled float8 gemm on CUDA needs {out_name} (here {n}) to be a multiple "
            f"of {n_align}{where}: keep this layer in hp (the blockwise recipe's default "
            "module filter does)"
        )
    recipe_b = "BlockWise128x128" if block_b == (bk, bk) else "BlockWise1x128"
    return BlockKernelPlan(-m % 4, -k % bk, "BlockWise1x128", recipe_b)


def check_gemm(a: torch.Tensor, b: torch.Tensor) -> None:
    """Both operands blockwise, with blocks of one length along the inner dim K."""
    if a._block is None or b._block is None or a._block[1] != b._block[0]:
        raise ValueError(
            f"scaled_mm: a block-scaled gemm needs both operands blockwise with one block "
            f"length along the inner dim; got {a._role.value} blocks {a._block} and "
            f"{b._role.value} blocks {b._block} (CastConfig.scaling_granularity and "
            "block_size of both operands of a gemm must match)"
        )


def _rows_per_element(inv: torch.Tensor, rows: int, count: int) -> torch.Tensor:
    # one entry per row of the operand from one per block of rows
    return inv.repeat_interleave(rows, dim=0)[:count] if rows > 1 else inv


def emulated_block_mm(a_data, b_data, inv_a, inv_b, block_a, block_b) -> torch.Tensor:
    """The block-scaled gemm's definition in fp32 (see the module docstring)."""
    (m, k), n, bk = a_data.shape, b_data.shape[1], block_a[1]
    pad_k = -k % bk
    kb = (k + pad_k) // bk
    a32 = F.pad(a_data.to(torch.float32), (0, pad_k)).reshape(m, kb, bk).transpose(0, 1)
    b32 = F.pad(b_data.to(torch.float32), (0, 0, 0, pad_k)).reshape(kb, bk, n)
    partial = torch.bmm(a32, b32)  # (KB, M, N): each K-block's sum in fp32
    sa = _rows_per_element(inv_a, block_a[0], m).t()  # (KB, M)
    sb = _rows_per_element(inv_b.t(), block_b[1], n).t()  # (KB, N)
    return (partial * (sa[:, :, None] * sb[:, None, :])).sum(dim=0)


def cuda_block_scales(
    inv_a: torch.Tensor, inv_b: torch.Tensor, plan: BlockKernelPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reciprocal block scales laid out as cuBLAS wants them: the left operand's (M, KB)
    M-major; a right operand's 128x128 (KB, NB) with KB padded to a multiple of 4 (padding
    1.0), K-major; its 128x1 (KB, N) as (N, KB), N-major."""
    inv_a = F.pad(inv_a, (0, 0, 0, plan.pad_m), value=1.0).t().contiguous().t()
    if plan.recipe_b == "BlockWise128x128":
        kb = inv_b.shape[0]
        inv_b = F.pad(inv_b.t(), (0, -kb % 4), value=1.0).contiguous().t()
    else:
        inv_b = inv_b.contiguous().t()
    return inv_a, inv_b
