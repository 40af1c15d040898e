"""The one place that calls ``torch._scaled_mm`` (and, for block scales, its successor
``torch.nn.functional.scaled_mm``); the grouped gemms of MoE experts are
``float8kit.grouped_gemm``.

``scaled_mm(a, b)`` multiplies two float8 training tensors, ``a`` (M, K) and ``b`` (K, N):
it puts A row-major and B column-major, turns our multiplying scales into the reciprocals
``_scaled_mm`` wants, broadcasts a tensorwise scale when the other operand is axiswise,
zero-pads the inner dim where asked or needed, and either calls the kernel or (``emulate``)
does the same math in fp32. ``kernel_plan`` holds the device rules (alignment, padding,
kernel output dtype) as a pure function of shapes, testable without a GPU.

Blockwise operands (1x128 tiles times 128x128 or 128x1 blocks) go to ``block_scaled_mm``:
on CUDA the cuBLAS block-scaled fp8 gemm that ``torch.nn.functional.scaled_mm`` runs with
``ScalingType.BlockWise1x128`` / ``BlockWise128x128`` (sm90+); elsewhere (``torch._scaled_mm``
on CPU takes no block scales) its definition in fp32: for every 128-long block of the inner
dim, the fp32 sum of the fp8 products, times both operands' block scales, summed.

NVFP4 operands (e2m1 codes, e4m3 scales per 16 along K, fp32 per tensor) go to
``nvfp4_scaled_mm``: on CUDA ``torch._scaled_mm`` on ``float4_e2m1fn_x2`` with blocked e4m3
scales (SM100); elsewhere both operands' values in fp32, multiplied in fp32.

MX operands (OCP MXFP8: e8m0 scales per 32 along K) go to ``mx_scaled_mm``: on CUDA
``torch._scaled_mm`` with the scales in cuBLAS's blocked layout (``to_blocked``, SM100);
elsewhere both operands dequantized to fp32 (exact) and multiplied in fp32.

``scaled_grouped_mm`` is the grouped (MoE experts) counterpart, over jagged groups;
``mx_scaled_grouped_mm`` its MX form (``torch._scaled_grouped_mm`` with e8m0 scales in the
kernel's per-group blocked layouts, computed without a host sync).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn.functional as F

from float8kit import nvfp4, versions
from float8kit.config import GEMMS, NVFP4_BLOCK, Float8Recipe
from float8kit.granularity import MX
from float8kit.tensor import Float8TrainingTensor

# cuBLAS fp8 gemms need these dims to be multiples of 16; the CPU kernel takes any size.
_CUDA_ALIGN = 16
# what an sm90 GPU runs instead of mxfp8 (named in versions.require_mx_kernels' error)
_NOT_MX_RECIPES = ", ".join(
    r.value for r in Float8Recipe if r not in (Float8Recipe.MXFP8, Float8Recipe.NVFP4)
)
_NOT_FP4_RECIPES = _NOT_MX_RECIPES


def _is_row_major(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(0) >= t.size(-1)


def _is_col_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(-1) >= t.size(0)


def _pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    pad = -t.size(dim) % multiple
    if pad == 0:
        return t
    # F.pad counts from the last dim: (last_lo, last_hi, first_lo, first_hi) for 2-D.
    spec = (0, pad, 0, 0) if dim == 1 else (0, 0, 0, pad)
    # Pad the bytes: float8 dtypes have no pad kernel on every device, uint8 does, and a zero
    # byte is +0.0 in both float8 formats.
    return F.pad(t.view(torch.uint8), spec).view(t.dtype)


def _operand_scales(a: Float8TrainingTensor, b: Float8TrainingTensor):
    """Reciprocal scales shaped for ``_scaled_mm``: () and () or (M, 1) and (1, N)."""
    inv_a = a._scale.to(torch.float32).reciprocal()
    inv_b = b._scale.to(torch.float32).reciprocal()
    m, n = a.shape[0], b.shape[1]
    if a._axiswise_dim is not None or b._axiswise_dim is not None:
        # _scaled_mm takes both rowwise or both tensorwise; expanding a tensorwise scale to a
        # row/column vector is exact and lets rowwise_with_gw_hp mix the two.
        inv_a = inv_a.reshape(-1, 1).expand(m, 1).contiguous()
        inv_b = inv_b.reshape(1, -1).expand(1, n).contiguous()
    else:
        # A 0-d scale is left as is: reshape(()) of a 0-d DTensor fails sharding propagation.
        inv_a, inv_b = (s if s.dim() == 0 else s.reshape(()) for s in (inv_a, inv_b))
    return inv_a, inv_b


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
_GEMM_DIMS = {g.name: (g.inner_dim, g.out_dim) for g in GEMMS}


def kernel_plan(
    k: int,
    n: int,
    out_dtype: torch.dtype,
    *,
    cuda: bool,
    rowwise: bool,
    pad_inner_dim: bool = False,
    gemm: str | None = None,
    use_fast_accum: bool = True,
) -> KernelPlan:
    """Padding and kernel output dtype of an (M, K) @ (K, N) float8 gemm; raises when the
    device's kernel cannot run it.

    CUDA (cuBLAS) needs K and N to be multiples of 16. N is a layer dim: when it is not
    aligned the layer must stay hp. K is zero-padded when ``pad_inner_dim`` is set, and
    always for the grad_weight gemm, whose K is the token count: it changes from batch to
    batch (an MoE expert gets any number of tokens), so no layer setting could fix it.
    ``pad_inner_dim`` also zero-pads N (the extra output columns are dropped), so that all
    three gemms of a layer whose in_features or out_features is not a multiple of 16 run:
    each of those dims is the inner dim of one gemm and the output dim of another.
    Rowwise-scaled CUDA kernels write only bf16: another ``out_dtype`` is produced as bf16
    and cast (an fp32 grad_weight keeps bf16 precision). A rowwise gemm without fast
    accumulation (the grad gemms) takes torchao's route instead: the tensorwise kernel with
    unit scales, fp32 out, times the row and column scales (``post_scale``), because the
    rowwise CUTLASS kernel is very slow without fast accumulation; the result is the same
    sums, rounded once. CPU takes any shape and dtype (padding only when ``pad_inner_dim``
    asks, to run the CUDA path's math).

    Args:
        k, n: the inner dim and the output's column dim.
        out_dtype: the dtype the caller wants.
        cuda: whether the operands are on a CUDA device.
        rowwise: whether the scales are per row/column.
        pad_inner_dim: ``Float8LinearConfig.pad_inner_dim``.
        gemm: ``"output"``, ``"grad_input"`` or ``"grad_weight"`` when known (messages, and
            the grad_weight gemm's automatic padding).
        use_fast_accum: whether the gemm asks for fast accumulation (CUDA routing).
    """
    align = _CUDA_ALIGN
    pad = -k % align if pad_inner_dim or (cuda and gemm == "grad_weight") else 0
    pad_out = -n % align if pad_inner_dim else 0
    if not cuda:
        return KernelPlan(pad, out_dtype, pad_out)
    inner_name, out_name = _GEMM_DIMS.get(gemm, ("the inner dim K", "the output dim N"))
    if n % align and not pad_out:
        raise ValueError(
            f"float8 gemm on CUDA needs {out_name} (here {n}) to be a multiple of 16"
            + (f" in the {gemm} gemm" if gemm else "")
            + ": set Float8LinearConfig.pad_inner_dim=True, or keep this layer in hp (the "
            "default module filter does)"
        )
    if k % align and not pad:
        raise ValueError(
            f"float8 gemm on CUDA needs {inner_name} (here {k}) to be a multiple of 16"
            + (f" in the {gemm} gemm" if gemm else "")
            + ": set Float8LinearConfig.pad_inner_dim=True, or keep this layer in hp (the "
            "default module filter does)"
        )
    if rowwise and not use_fast_accum:
        return KernelPlan(pad, torch.float32, pad_out, post_scale=True)
    kernel_out = torch.bfloat16 if rowwise else out_dtype
    return KernelPlan(pad, kernel_out, pad_out)


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
            f"and {block_b[0]}x{block_b[1]}{where}: use CastConfig.block_size={bk}"
        )
    n_align = bk if block_b == (bk, bk) else _CUDA_ALIGN
    if n % n_align:
        _, out_name = _GEMM_DIMS.get(gemm, ("", "the output dim N"))
        raise ValueError(
            f"block-scaled float8 gemm on CUDA needs {out_name} (here {n}) to be a multiple "
            f"of {n_align}{where}: keep this layer in hp (the blockwise recipe's default "
            "module filter does)"
        )
    recipe_b = "BlockWise128x128" if block_b == (bk, bk) else "BlockWise1x128"
    return BlockKernelPlan(-m % 4, -k % bk, "BlockWise1x128", recipe_b)


def _check_blocks(a: Float8TrainingTensor, b: Float8TrainingTensor) -> None:
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


def _emulated_block_mm(a_data, b_data, inv_a, inv_b, block_a, block_b) -> torch.Tensor:
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


def block_scaled_mm(
    a: Float8TrainingTensor,
    b: Float8TrainingTensor,
    *,
    emulate: bool = False,
    out_dtype: torch.dtype,
    gemm: str | None = None,
) -> torch.Tensor:
    """``a @ b`` for blockwise float8 tensors (see the module docstring); use ``scaled_mm``.
    Fast accumulation does not apply: the kernel promotes every 128-block to fp32."""
    _check_blocks(a, b)
    inv_a = a._scale.to(torch.float32).reciprocal()
    inv_b = b._scale.to(torch.float32).reciprocal()
    if emulate or not a._data.is_cuda:
        out = _emulated_block_mm(a._data, b._data, inv_a, inv_b, a._block, b._block)
    else:
        out = _kernel_block_mm(a._data, b._data, inv_a, inv_b, a._block, b._block, gemm)
    return out.to(out_dtype)


def _kernel_block_mm(a_data, b_data, inv_a, inv_b, block_a, block_b, gemm) -> torch.Tensor:
    """The CUDA kernel call (bf16 out); on the meta device it checks the layouts without a
    GPU (torch's meta function mirrors the kernel's checks)."""
    if not versions.HAS_BLOCK_SCALED_MM:
        raise RuntimeError(
            f"blockwise float8 gemms on CUDA need torch.nn.functional.scaled_mm (torch "
            f">= 2.10; this is {torch.__version__}): upgrade torch, or set "
            "Float8LinearConfig.emulate=True to run their fp32 definition"
        )
    (m, k), n = a_data.shape, b_data.shape[1]
    plan = block_kernel_plan(m, k, n, block_a, block_b, gemm)
    inv_a, inv_b = cuda_block_scales(inv_a, inv_b, plan)
    if not _is_row_major(a_data):
        a_data = a_data.contiguous()
    if not _is_col_major(b_data):
        b_data = b_data.t().contiguous().t()
    a_data = _pad_to(_pad_to(a_data, 1, 128), 0, 4)
    b_data = _pad_to(b_data.t(), 1, 128).t()
    out = F.scaled_mm(
        a_data,
        b_data,
        inv_a,
        getattr(F.ScalingType, plan.recipe_a),
        inv_b,
        getattr(F.ScalingType, plan.recipe_b),
        output_dtype=torch.bfloat16,
    )
    return out[:m]


# ---------------------------------------------------------------------------- MX


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


def _check_mx(a: Float8TrainingTensor, b: Float8TrainingTensor) -> None:
    """Both operands MX, blocked along the inner dim K (the left's dim 1, the right's dim 0)."""
    if a._gran.mx_dim != 1 or b._gran.mx_dim != 0:
        raise ValueError(
            f"scaled_mm: an MX gemm needs both operands in MX blocks along the inner dim K; got "
            f"{a._role.value} {a._gran.short()} @ {b._role.value} {b._gran.short()} "
            "(CastConfig.scaling_granularity of both operands of a gemm must be MX, and each "
            "is cast along the dim its gemm reduces)"
        )


def mx_scaled_mm(
    a: Float8TrainingTensor,
    b: Float8TrainingTensor,
    *,
    emulate: bool = False,
    out_dtype: torch.dtype,
    gemm: str | None = None,
) -> torch.Tensor:
    """``a @ b`` for MX operands (use ``scaled_mm``). CUDA: ``torch._scaled_mm`` with e8m0
    scales in cuBLAS's blocked layout (``to_blocked``), bf16 out (SM100; an older GPU raises
    ``versions.require_mx_kernels``' error before any kernel). Elsewhere, and with
    ``emulate``: both operands dequantized to fp32 (exact: float8 values times powers of two)
    and multiplied in fp32, the kernel's math up to the order of its fp32 sums."""
    _check_mx(a, b)
    if emulate or not a._data.is_cuda:
        return _mx_emulated_mm(a._data, a._scale, b._data, b._scale).to(out_dtype)
    versions.require_mx_kernels(a._data.device, "Float8LinearConfig", _NOT_MX_RECIPES)
    a_data, b_data, scale_a, scale_b = mx_kernel_operands(a, b, gemm)
    out = _kernel(a_data, b_data, scale_a, scale_b, torch.bfloat16, False)
    return out.to(out_dtype)


@torch.library.custom_op("float8kit::mx_emulated_mm", mutates_args=())
def _mx_emulated_mm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor
) -> torch.Tensor:
    """The MX gemm off CUDA: ``a`` (M, K) and ``b`` (K, N) float8 data with their e8m0 scale
    bytes along K, both dequantized to fp32 (exact) and multiplied in fp32; fp32 out. An
    opaque op to ``torch.compile``, which fused the dequantization with the casts that make
    its operands and got it wrong: torch 2.13's CPU inductor gave wrong grad_weights when
    the token count is not a multiple of 32 (fp32, 256 -> 512 layer: 5.8 dB vs eager),
    torch 2.11's failed to generate the kernel (an AssertionError in its loop split).
    Opaque, compiled is bitwise eager for this gemm (tests/test_compile.py)."""
    return MX(1).dequantize(a, a_scale) @ MX(0).dequantize(b, b_scale)


@_mx_emulated_mm.register_fake
def _(a, a_scale, b, b_scale):
    return a.new_empty((a.size(0), b.size(1)), dtype=torch.float32)


def mx_kernel_operands(
    a: Float8TrainingTensor, b: Float8TrainingTensor, gemm: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the CUDA MX gemm hands ``torch._scaled_mm`` for MX ``a @ b``: A row-major and B
    column-major, K zero-padded to whole 32-blocks where ``mx_kernel_plan`` says so (zero
    bytes: +0.0, exact), and both scales in cuBLAS's blocked layout (``to_blocked``) as
    ``torch.float8_e8m0fnu``: A's (M, K / 32), B's transposed to (N, K / 32). Runs on any
    device (the bytes are moved, never converted), so the layout is testable on CPU."""
    _check_mx(a, b)
    plan = mx_kernel_plan(a.shape[1], b.shape[1], gemm)
    a_data, b_data = a._data, b._data
    if not _is_row_major(a_data):
        a_data = a_data.contiguous()
    if not _is_col_major(b_data):
        b_data = b_data.t().contiguous().t()
    if plan.pad_inner:  # a partial last 32-block of K (a token count)
        a_data = _pad_to(a_data, 1, 32)
        b_data = _pad_to(b_data.t(), 1, 32).t()
    e8m0 = torch.float8_e8m0fnu  # the bytes, as the kernel's dtype
    scale_a = to_blocked(a._scale).view(e8m0)  # (M, K / 32)
    scale_b = to_blocked(b._scale.t()).view(e8m0)  # (N, K / 32)
    return a_data, b_data, scale_a, scale_b


def mx_kernel_plan(k: int, n: int, gemm: str | None = None) -> KernelPlan:
    """How the CUDA MX gemm runs an (M, K) @ (K, N) gemm: K zero-padded to whole 32-blocks
    (a token count in the grad_weight gemm), bf16 out; raises when N is not a multiple of
    16 (cuBLAS's rule) or K is not a multiple of 32 outside the grad_weight gemm (a layer
    dim: the default module filter keeps such layers in hp)."""
    return _k32_plan("MX float8", k, n, gemm, torch.bfloat16)


def _k32_plan(what: str, k: int, n: int, gemm: str | None, out_dtype: torch.dtype) -> KernelPlan:
    """The plan of a block-scaled CUDA gemm whose K runs in 32s (MX, NVFP4): K zero-padded
    to a multiple of 32 in the grad_weight gemm only (a token count), N a multiple of 16."""
    inner_name, out_name = _GEMM_DIMS.get(gemm, ("the inner dim K", "the output dim N"))
    where = f" in the {gemm} gemm" if gemm else ""
    if n % _CUDA_ALIGN:
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


# ---------------------------------------------------------------------------- NVFP4


def _check_nvfp4(a: Float8TrainingTensor, b: Float8TrainingTensor) -> None:
    """Both operands NVFP4 with 16-element blocks along the inner dim K, both Hadamard-
    transformed along K or neither (the transform cancels only in such a product)."""
    ga, gb = a._gran, b._gran
    ok = (
        ga.nvfp4_block is not None
        and gb.nvfp4_block is not None
        and ga.nvfp4_block[1] == NVFP4_BLOCK
        and gb.nvfp4_block[0] == NVFP4_BLOCK
        and ga.hadamard == gb.hadamard
        and (not ga.hadamard or (ga.nvfp4_block[0] == 1 and gb.nvfp4_block[1] == 1))
    )
    if not ok:
        raise ValueError(
            f"scaled_mm: an NVFP4 gemm needs both operands in NVFP4 blocks of 16 along the "
            f"inner dim K, both Hadamard-transformed along K or neither; got "
            f"{a._role.value} {ga.short()} @ {b._role.value} {gb.short()} (each operand "
            "is cast along the dim its gemm reduces)"
        )


def nvfp4_scaled_mm(
    a: Float8TrainingTensor,
    b: Float8TrainingTensor,
    *,
    emulate: bool = False,
    out_dtype: torch.dtype,
    gemm: str | None = None,
) -> torch.Tensor:
    """``a @ b`` for NVFP4 operands (use ``scaled_mm``). CUDA: ``torch._scaled_mm`` on
    ``float4_e2m1fn_x2`` operands with their e4m3 block scales in cuBLAS's blocked layout
    (``nvfp4_kernel_operands``), fp32 out, times both tensor scales (SM100; an older GPU
    raises ``versions.require_mx_kernels``' error before any kernel). Elsewhere, and with
    ``emulate``: both operands' values in fp32 (e2m1 times block scale times tensor scale,
    torchao's dequantization) multiplied in fp32."""
    _check_nvfp4(a, b)
    if emulate or not a._data.is_cuda:
        return _nvfp4_emulated_mm(
            a._data, a._scale, list(a._gran.nvfp4_block), b._data, b._scale,
            list(b._gran.nvfp4_block),
        ).to(out_dtype)  # fmt: skip
    versions.require_mx_kernels(
        a._data.device, "Float8LinearConfig", _NOT_FP4_RECIPES, "the nvfp4 recipe's gemms", "NVFP4"
    )
    a_fp4, b_fp4, scale_a, scale_b, tensor_scale = nvfp4_kernel_operands(a, b, gemm)
    out = _kernel(a_fp4, b_fp4, scale_a, scale_b, torch.float32, False)
    # cuBLAS applies the block scales; the tensor scales multiply the fp32 result once
    return (out * tensor_scale).to(out_dtype)


@torch.library.custom_op("float8kit::nvfp4_emulated_mm", mutates_args=())
def _nvfp4_emulated_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_block: list[int],
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_block: list[int],
) -> torch.Tensor:
    """The NVFP4 gemm off CUDA: e2m1 codes ``a`` (M, K) and ``b`` (K, N) with their scales
    (``granularity.NVFP4``) as fp32 values, multiplied in fp32; fp32 out. Opaque to
    ``torch.compile`` (as ``mx_emulated_mm``): compiled is bitwise eager for this gemm."""
    return nvfp4.values(a, a_scale, tuple(a_block)) @ nvfp4.values(b, b_scale, tuple(b_block))


@_nvfp4_emulated_mm.register_fake
def _(a, a_scale, a_block, b, b_scale, b_block):
    return a.new_empty((a.size(0), b.size(1)), dtype=torch.float32)


def _per_row_blocks(scale: torch.Tensor, block: tuple[int, int], rows: int) -> torch.Tensor:
    """(rows, K / 16) block scales of an operand blocked 16 along its dim 1 (its K): a 16x16
    block's scale repeated for each of its rows."""
    return scale.repeat_interleave(block[0], dim=0)[:rows]


def nvfp4_kernel_operands(
    a: Float8TrainingTensor, b: Float8TrainingTensor, gemm: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the CUDA NVFP4 gemm hands ``torch._scaled_mm`` for ``a @ b``: A (M, K / 2) and B
    (K / 2, N) column-major as ``torch.float4_e2m1fn_x2`` (codes packed two per byte along
    K, ``nvfp4.pack``), K zero-padded to whole 32s where ``nvfp4_kernel_plan`` says so (code
    0 = +0.0); A's block scales (M, K / 16) and B's (N, K / 16) as e4m3 in cuBLAS's blocked
    layout (``to_blocked``); and the product of both tensor scales (fp32, 0-d), which
    multiplies the result. Runs on any device (the codes are moved, never rounded), so the
    layout is testable on CPU."""
    _check_nvfp4(a, b)
    pad = nvfp4_kernel_plan(a.shape[1], b.shape[1], gemm).pad_inner
    a_codes, b_codes = a._data, b._data.t()  # both (rows, K), K contiguous after packing
    sa = _per_row_blocks(a._scale[0], a._gran.nvfp4_block, a.shape[0])
    b_block = b._gran.nvfp4_block
    sb = _per_row_blocks(b._scale[0].t(), (b_block[1], b_block[0]), b.shape[1])
    if pad:  # zero codes; the padded K blocks' scales are 0 (a 16-block of zeros either way)
        a_codes, b_codes = _pad_to(a_codes, 1, 32), _pad_to(b_codes, 1, 32)
        blocks = (a.shape[1] + pad) // NVFP4_BLOCK
        sa, sb = (F.pad(s, (0, blocks - s.shape[1])) for s in (sa, sb))
    fp4 = torch.float4_e2m1fn_x2
    a_fp4 = nvfp4.pack(a_codes.contiguous()).view(fp4)
    b_fp4 = nvfp4.pack(b_codes.contiguous()).view(fp4).t()
    e4m3 = torch.float8_e4m3fn
    scale_a = to_blocked(sa.to(e4m3).view(torch.uint8)).view(e4m3)
    scale_b = to_blocked(sb.to(e4m3).view(torch.uint8)).view(e4m3)
    tensor_scale = a._scale[1].reshape(-1)[0] * b._scale[1].reshape(-1)[0]
    return a_fp4, b_fp4, scale_a, scale_b, tensor_scale


def nvfp4_kernel_plan(k: int, n: int, gemm: str | None = None) -> KernelPlan:
    """How the CUDA NVFP4 gemm runs an (M, K) @ (K, N) gemm: K zero-padded to a multiple of
    32 (16 packed bytes, cuBLAS's rule) in the grad_weight gemm (a token count), fp32 out;
    raises when N is not a multiple of 16 or K not a multiple of 32 elsewhere (a layer dim:
    the default module filter keeps such layers in hp)."""
    return _k32_plan("NVFP4", k, n, gemm, torch.float32)


def _check_axes(a: Float8TrainingTensor, b: Float8TrainingTensor) -> None:
    """Axiswise scales must span the inner dim K: one per row of ``a``, per column of ``b``.
    Scales along the other dim have the same shape when M == K or K == N and would be
    applied to the wrong slices without any error."""
    for name, t, dim, what in (("left", a, 1, "row"), ("right", b, 0, "column")):
        if t._axiswise_dim not in (None, dim):
            raise ValueError(
                f"scaled_mm: the {name} operand {tuple(t.shape)} ({t._role.value}) has "
                f"axiswise scales along dim {t._axiswise_dim}, but a gemm needs one scale per "
                f"{what}, i.e. scales along its dim {dim} (the inner dim K): cast it with "
                f"reduce_dim={dim}, or transpose the tensor that was cast"
            )


def scaled_mm(
    a: Float8TrainingTensor,
    b: Float8TrainingTensor,
    *,
    use_fast_accum: bool = False,
    emulate: bool = False,
    pad_inner_dim: bool = False,
    out_dtype: torch.dtype | None = None,
    gemm: str | None = None,
) -> torch.Tensor:
    """``a @ b`` for float8 training tensors, in hp.

    Args:
        a: (M, K) float8 tensor; axiswise scales must be per row (shape (M, 1)).
        b: (K, N) float8 tensor; axiswise scales must be per column (shape (1, N)).
        use_fast_accum: faster, less precise accumulation (CUDA only).
        emulate: do the math in fp32 (``(A @ B) / (scale_a * scale_b)``) instead of the kernel.
        pad_inner_dim: zero-pad K to a multiple of 16 (needed on CUDA for odd K).
        out_dtype: result dtype; default ``a``'s hp dtype.
        gemm: which gemm of a linear layer this is, if any (see ``kernel_plan``).

    Returns:
        The (M, N) product in ``out_dtype``. An empty operand (M, K or N is 0) gives zeros
        without calling a kernel.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"scaled_mm needs (M, K) @ (K, N); got {tuple(a.shape)} @ {tuple(b.shape)}"
        )
    out_dtype = out_dtype or a._orig_dtype
    if a._gran.nvfp4_block is not None or b._gran.nvfp4_block is not None:
        if 0 in (a.shape[0], a.shape[1], b.shape[1]):
            return torch.zeros((a.shape[0], b.shape[1]), dtype=out_dtype, device=a._data.device)
        return nvfp4_scaled_mm(a, b, emulate=emulate, out_dtype=out_dtype, gemm=gemm)
    if a._gran.mx_dim is not None or b._gran.mx_dim is not None:
        if 0 in (a.shape[0], a.shape[1], b.shape[1]):
            return torch.zeros((a.shape[0], b.shape[1]), dtype=out_dtype, device=a._data.device)
        return mx_scaled_mm(a, b, emulate=emulate, out_dtype=out_dtype, gemm=gemm)
    blockwise = a._block is not None or b._block is not None
    if not blockwise:
        _check_axes(a, b)
    a_data, b_data = a._data, b._data
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    if m == 0 or k == 0 or n == 0:
        # A sum over nothing is 0; cuBLAS has no business with empty operands.
        return torch.zeros((m, n), dtype=out_dtype, device=a_data.device)
    if blockwise:
        return block_scaled_mm(a, b, emulate=emulate, out_dtype=out_dtype, gemm=gemm)
    inv_a, inv_b = _operand_scales(a, b)

    if emulate:
        out = (a_data.to(torch.float32) @ b_data.to(torch.float32)) * inv_a * inv_b
        return out.to(out_dtype)

    rowwise = a._axiswise_dim is not None or b._axiswise_dim is not None
    plan = kernel_plan(
        k,
        n,
        out_dtype,
        cuda=a_data.is_cuda,
        rowwise=rowwise,
        pad_inner_dim=pad_inner_dim,
        gemm=gemm,
        use_fast_accum=use_fast_accum,
    )
    if not _is_row_major(a_data):
        a_data = a_data.contiguous()
    if not _is_col_major(b_data):
        b_data = b_data.t().contiguous().t()
    if plan.pad_inner:
        a_data = _pad_to(a_data, 1, _CUDA_ALIGN)
        b_data = _pad_to(b_data.t(), 1, _CUDA_ALIGN).t()
    if plan.pad_out:
        b_data = _pad_to(b_data.t(), 0, _CUDA_ALIGN).t()  # zero columns, still column-major
        if inv_b.dim() == 2:
            inv_b = F.pad(inv_b, (0, plan.pad_out), value=1.0)
    kernel = _kernel if a_data.is_cuda else _cpu_kernel
    if plan.post_scale:
        one = inv_a.new_ones(())
        out = kernel(a_data, b_data, one, one, plan.kernel_out_dtype, use_fast_accum)
        out = out * inv_a * inv_b
    else:
        out = kernel(a_data, b_data, inv_a, inv_b, plan.kernel_out_dtype, use_fast_accum)
    if plan.pad_out:
        out = out[:, :n]
    return out.to(out_dtype)


def _kernel(
    a: torch.Tensor,
    b: torch.Tensor,
    inv_a: torch.Tensor,
    inv_b: torch.Tensor,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
) -> torch.Tensor:
    """The one ``torch._scaled_mm`` call: A row-major, B column-major, reciprocal scales."""
    return torch._scaled_mm(
        a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum
    )


@torch.library.custom_op("float8kit::cpu_scaled_mm", mutates_args=())
def _cpu_kernel(
    a: torch.Tensor,
    b: torch.Tensor,
    inv_a: torch.Tensor,
    inv_b: torch.Tensor,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
) -> torch.Tensor:
    """``torch._scaled_mm`` on CPU with oneDNN off for the call, an opaque op to compile.

    On CPUs with AVX512-FP16 / AMX (e.g. Sapphire Rapids and newer Xeons) torch hands a
    same-dtype float8 gemm (e4m3 x e4m3) to oneDNN, whose only float8 matmul there is its
    reference implementation: 1000x slower than torch's own CPU kernel (fp32 upcast, scale,
    sgemm), which every other CPU gets (a 1024x256x512 gemm: 6.4 s vs 18 ms on one core).
    Switching oneDNN off is not something dynamo can trace, hence the custom op; the bf16
    ops around the gemm keep oneDNN. (``torch.backends.mkldnn.flags`` would also reset the
    TF32 flag, with a warning per call: the switch alone is set and restored here.)"""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        if (inv_a.numel() > 1 or inv_b.numel() > 1) and not versions.cpu_rowwise_scaled_mm():
            # the per-tensor kernel with scales of one (exact fp32 sums of float8 products),
            # then the row / column scales in fp32: rowwise's math on a torch whose CPU
            # kernel takes per-tensor scales only
            _warn_rowwise_emulated()
            one = torch.ones((), dtype=torch.float32)
            out = _kernel(a, b, one, one, torch.float32, use_fast_accum)
            return (out * inv_a * inv_b).to(out_dtype)
        return _kernel(a, b, inv_a, inv_b, out_dtype, use_fast_accum)
    finally:
        torch._C._set_mkldnn_enabled(enabled)


_ROWWISE_WARNED = False


def _warn_rowwise_emulated() -> None:
    global _ROWWISE_WARNED
    if not _ROWWISE_WARNED:
        _ROWWISE_WARNED = True
        warnings.warn(
            f"float8kit: torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales "
            "only; rowwise float8 gemms on CPU run it with scales of one and apply the row "
            "and column scales in fp32 after it (the same math, one more pass over the "
            "output); torch 2.13 and newer have the rowwise CPU kernel.",
            stacklevel=3,
        )


@_cpu_kernel.register_fake
def _(a, b, inv_a, inv_b, out_dtype, use_fast_accum):
    return a.new_empty((a.size(0), b.size(1)), dtype=out_dtype)
