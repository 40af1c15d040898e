"""The CUDA kernel of ``float8kit::cast_tensorwise`` (float8kit/cast.py): one read of the hp
operand writes its float8 data in up to two layouts (row-major, and the transpose a second
gemm takes) and the partial maxima of ``|hp|`` (a DELAYED cast's amax record), so that no
second pass re-reads the hp tensor.

Bitwise the reference (``cast.cast_tensorwise_reference``): the same fp32 math
(``hp.float() * scale``, a NaN-keeping clamp to the float8 range, non-finite values restored
when guarded), then round-to-nearest-even to float8; inf and NaN get torch's own bytes
(e4m3fn: 0x7F | sign for both; e5m2: 0x7C | sign for inf, 0x7F | sign for NaN) instead of the
conversion instruction's saturation. Imported only where CUDA runs it (triton ships with
torch's CUDA wheels); checked against the reference on the GPU by tests/test_gpu.py.

Internal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from float8kit import scaling
from float8kit.config import E4M3

# The tile one program casts (rows, columns, warps): benchmarks/bench_cast.py times the
# candidates on a GPU; its JSON (benchmarks/results/) records the choice.
TILE = (64, 128, 4)


@triton.jit
def _cast_kernel(
    hp_ptr,
    scale_ptr,
    row_ptr,
    col_ptr,
    amax_ptr,
    M,
    N,
    LIMIT: tl.constexpr,
    E4M3FN: tl.constexpr,
    GUARD: tl.constexpr,
    ROW: tl.constexpr,
    COL: tl.constexpr,
    AMAX: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pn * BN + tl.arange(0, BN)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(hp_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    if AMAX:  # max |x| as the bits of a non-negative float: NaN > inf > finite, exact
        bits = tl.abs(x).to(tl.int32, bitcast=True)
        tl.store(amax_ptr + pm * tl.num_programs(1) + pn, tl.max(tl.max(bits, axis=1), axis=0))
    scaled = x * tl.load(scale_ptr)
    clamped = tl.minimum(
        tl.maximum(scaled, -LIMIT, propagate_nan=tl.PropagateNan.ALL),
        LIMIT,
        propagate_nan=tl.PropagateNan.ALL,
    )
    if GUARD:  # inf/NaN back after the clamp (cast.to_fp8_saturated)
        if E4M3FN:
            clamped = clamped + (scaled - scaled)
        else:
            clamped = tl.where(scaled - scaled == 0.0, clamped, scaled)
    sign = ((clamped.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    if E4M3FN:
        byte = clamped.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        byte = tl.where(clamped != clamped, sign | 0x7F, byte)
    else:
        byte = clamped.to(tl.float8e5).to(tl.uint8, bitcast=True)
        inf = tl.abs(clamped) == float("inf")
        byte = tl.where(clamped != clamped, sign | 0x7F, tl.where(inf, sign | 0x7C, byte))
    if ROW:
        tl.store(row_ptr + rm[:, None] * N + rn[None, :], byte, mask=mask)
    if COL:
        tl.store(col_ptr + rn[:, None] * M + rm[None, :], tl.trans(byte), mask=tl.trans(mask))


def cast_tensorwise(
    hp: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    guard: bool,
    row: bool,
    col: bool,
    amax: bool,
    limit: float,
    tile: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``float8kit::cast_tensorwise`` on CUDA: one kernel (see the module doc); ``tile``
    overrides ``TILE`` (benchmarks)."""
    hp = hp.contiguous()
    m, n = hp.shape
    data = hp.new_empty((m, n) if row else (0,), dtype=fp8_dtype)
    data_t = hp.new_empty((n, m) if col else (0,), dtype=fp8_dtype)
    bm, bn, warps = tile or TILE
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    partial = hp.new_empty((grid[0] * grid[1] if amax else 1,), dtype=torch.int32)

    if hp.numel():
        _cast_kernel[grid](
            hp,
            scale.to(torch.float32),
            data.view(torch.uint8),
            data_t.view(torch.uint8),
            partial,
            m,
            n,
            LIMIT=limit,
            E4M3FN=fp8_dtype == E4M3,
            GUARD=guard,
            ROW=row,
            COL=col,
            AMAX=amax,
            BM=bm,
            BN=bn,
            num_warps=warps,
        )
    if not amax:
        return data, data_t, hp.new_empty((0,), dtype=torch.float32)
    if not hp.numel():
        return data, data_t, hp.new_zeros((), dtype=torch.float32)
    return data, data_t, scaling.amax_of_partial_bits(partial)
