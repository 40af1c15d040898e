"""What the CUDA float8 kernels want of their operands, shared by the formats' gemm plans
(float8kit.gemm calls the kernels): A row-major and B column-major, zero padding along a
dim (zero bytes are +0.0 in every float8 format and code 0 in e2m1), cuBLAS's blocked scale
layout (MX's e8m0 and NVFP4's e4m3 block scales), and the ``KernelPlan`` of one gemm."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from float8kit.config import GEMMS

# cuBLAS fp8 gemms need these dims to be multiples of 16; the CPU kernel takes any size.
CUDA_ALIGN = 16


def is_row_major(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(0) >= t.size(-1)


def is_col_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(-1) >= t.size(0)


def kernel_layouts(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A row-major and B column-major, as the kernels take them (a copy only where not)."""
    if not is_row_major(a):
        a = a.contiguous()
    if not is_col_major(b):
        b = b.t().contiguous().t()
    return a, b


def pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    pad = -t.size(dim) % multiple
    if pad == 0:
        return t
    # F.pad counts from the last dim: (last_lo, last_hi, first_lo, first_hi) for 2-D.
    spec = (0, pad, 0, 0) if dim == 1 else (0, 0, 0, pad)
    # Pad the bytes: float8 dtypes have no pad kernel on every device, uint8 does, and a zero
    # byte is +0.0 in both float8 formats.
    return F.pad(t.view(torch.uint8), spec).view(t.dtype)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """How ``_scaled_mm`` runs one gemm: ``pad_inner`` zeros appended to the inner dim (zeros
    add nothing to the sums: the result is unchanged), and the dtype the kernel writes
    (``kernel_out_dtype``; the result is cast to the requested dtype when it differs)."""

    pad_inner: int
    kernel_out_dtype: torch.dtype
    # zeros appended to N (``pad_inner_dim`` on a layer dim; the extra columns are dropped)
    pad_out: int = 0
    # run the tensorwise kernel with unit scales (fp32 out), then multiply by the rowwise
    # scales: the CUDA rowwise kernel without fast accumulation is many times slower
    post_scale: bool = False


# The dims of each of a linear layer's gemms, for error messages: (inner dim, output dim N).
GEMM_DIMS = {g.name: (g.inner_dim, g.out_dim) for g in GEMMS}


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """An (H, W) MX scale (one byte per row and 32-block of K) in cuBLAS's blocked layout:
    zero-padded to (ceil(H / 128) * 128, ceil(W / 4) * 4), then cut in 128 x 4 tiles, row
    tiles first; inside a tile, element (r, c) sits at ``(r % 32) * 16 + (r // 32) * 4 + c``
    (the "32_4_4" swizzle). Flat, contiguous, uint8 bytes (moved, never converted)."""
    h, w = scale.shape
    pad_h, pad_w = -h % 128, -w % 4
    x = scale
    if pad_h or pad_w:
        x = F.pad(x, (0, pad_w, 0, pad_h))
    hb, wb = (h + pad_h) // 128, (w + pad_w) // 4
    # index [r // 128, (r % 128) // 32, r % 32, c // 4, c % 4]
    #    to [r // 128, c // 4, r % 32, (r % 128) // 32, c % 4]
    tiles = x.reshape(hb, 4, 32, wb, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(-1)


def k32_plan(what: str, k: int, n: int, gemm: str | None, out_dtype: torch.dtype) -> KernelPlan:
    """The plan of a block-scaled CUDA gemm whose K runs in 32s (MX, NVFP4): K zero-padded
    to a multiple of 32 in the grad_weight gemm only (a token count), N a multiple of 16."""
    inner_name, out_name = GEMM_DIMS.get(gemm, ("the inner dim K", "the output dim N"))
    where = f" in the {gemm} gemm" if gemm else ""
    if n % CUDA_ALIGN:
        raise ValueError(
            f"{what} gemm on CUDA needs {out_name} (here {n}) to be a multiple of 16{where}: "
            "keep this layer in hp (the default module filter does)"
        )
    if k % 32 and gemm != "grad_weight":
        raise ValueError(
            f"{what} gemm needs {inner_name} (here {k}) to be a multiple of 32{where}: "
            "keep this layer in hp (the default module filter does)"
        )
    return KernelPlan(-k % 32, out_dtype)
