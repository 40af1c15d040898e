"""The one place that calls ``torch._scaled_mm``.

``scaled_mm(a, b)`` multiplies two float8 training tensors, ``a`` (M, K) and ``b`` (K, N):
it puts A row-major and B column-major, turns our multiplying scales into the reciprocals
``_scaled_mm`` wants, broadcasts a tensorwise scale when the other operand is axiswise,
optionally zero-pads the inner dim, and either calls the kernel or (``emulate``) does the
same math in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from float8kit.tensor import Float8TrainingTensor

# cuBLAS fp8 gemms need these dims to be multiples of 16; the CPU kernel takes any size.
_CUDA_ALIGN = 16


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
        inv_a, inv_b = inv_a.reshape(()), inv_b.reshape(())
    return inv_a, inv_b


def scaled_mm(
    a: Float8TrainingTensor,
    b: Float8TrainingTensor,
    *,
    use_fast_accum: bool = False,
    emulate: bool = False,
    pad_inner_dim: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``a @ b`` for float8 training tensors, in hp.

    Args:
        a: (M, K) float8 tensor; axiswise scales must be per row (shape (M, 1)).
        b: (K, N) float8 tensor; axiswise scales must be per column (shape (1, N)).
        use_fast_accum: faster, less precise accumulation (CUDA only).
        emulate: do the math in fp32 (``(A @ B) / (scale_a * scale_b)``) instead of the kernel.
        pad_inner_dim: zero-pad K to a multiple of 16 (needed on CUDA for odd K).
        out_dtype: result dtype; default ``a``'s hp dtype.

    Returns:
        The (M, N) product in ``out_dtype``.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"scaled_mm needs (M, K) @ (K, N); got {tuple(a.shape)} @ {tuple(b.shape)}"
        )
    out_dtype = out_dtype or a._orig_dtype
    a_data, b_data = a._data, b._data
    inv_a, inv_b = _operand_scales(a, b)

    if emulate:
        out = (a_data.to(torch.float32) @ b_data.to(torch.float32)) * inv_a * inv_b
        return out.to(out_dtype)

    if not _is_row_major(a_data):
        a_data = a_data.contiguous()
    if not _is_col_major(b_data):
        b_data = b_data.t().contiguous().t()
    if pad_inner_dim:
        a_data = _pad_to(a_data, 1, _CUDA_ALIGN)
        b_data = _pad_to(b_data.t(), 1, _CUDA_ALIGN).t()
    if a_data.is_cuda:
        k, n = a_data.shape[1], b_data.shape[1]
        if k % _CUDA_ALIGN or n % _CUDA_ALIGN:
            raise ValueError(
                f"float8 gemm on CUDA needs the inner dim K={k} and output dim N={n} to be "
                "multiples of 16: keep this layer in hp (the default module filter does), or "
                "set Float8LinearConfig.pad_inner_dim=True when only K is odd"
            )
    return torch._scaled_mm(
        a_data,
        b_data,
        scale_a=inv_a,
        scale_b=inv_b,
        out_dtype=out_dtype,
        use_fast_accum=use_fast_accum,
    )
