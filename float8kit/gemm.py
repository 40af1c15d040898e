"""The one place that calls ``torch._scaled_mm``.

``scaled_mm(a, b)`` multiplies two float8 training tensors, ``a`` (M, K) and ``b`` (K, N):
it puts A row-major and B column-major, turns our multiplying scales into the reciprocals
``_scaled_mm`` wants, broadcasts a tensorwise scale when the other operand is axiswise,
zero-pads the inner dim where asked or needed, and either calls the kernel or (``emulate``)
does the same math in fp32. ``kernel_plan`` holds the device rules (alignment, padding,
kernel output dtype) as a pure function of shapes, testable without a GPU.
"""

from __future__ import annotations

import dataclasses

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


# The dims of each of a linear layer's gemms, for error messages: (inner dim, output dim N).
_GEMM_DIMS = {
    "output": ("in_features", "out_features"),
    "grad_input": ("out_features", "in_features"),
    "grad_weight": ("the token count (the input's leading dims flattened)", "in_features"),
}


def kernel_plan(
    k: int,
    n: int,
    out_dtype: torch.dtype,
    *,
    cuda: bool,
    rowwise: bool,
    pad_inner_dim: bool = False,
    gemm: str | None = None,
) -> KernelPlan:
    """Padding and kernel output dtype of an (M, K) @ (K, N) float8 gemm; raises when the
    device's kernel cannot run it.

    CUDA (cuBLAS) needs K and N to be multiples of 16. N is a layer dim: when it is not
    aligned the layer must stay hp. K is zero-padded when ``pad_inner_dim`` is set, and
    always for the grad_weight gemm, whose K is the token count: it changes from batch to
    batch (an MoE expert gets any number of tokens), so no layer setting could fix it.
    Rowwise-scaled CUDA kernels write only bf16: another ``out_dtype`` is produced as bf16
    and cast (an fp32 grad_weight keeps bf16 precision). CPU takes any shape and dtype
    (padding only when ``pad_inner_dim`` asks, to run the CUDA path's math).

    Args:
        k, n: the inner dim and the output's column dim.
        out_dtype: the dtype the caller wants.
        cuda: whether the operands are on a CUDA device.
        rowwise: whether the scales are per row/column.
        pad_inner_dim: ``Float8LinearConfig.pad_inner_dim``.
        gemm: ``"output"``, ``"grad_input"`` or ``"grad_weight"`` when known (messages, and
            the grad_weight gemm's automatic padding).
    """
    align = _CUDA_ALIGN
    pad = -k % align if pad_inner_dim or (cuda and gemm == "grad_weight") else 0
    if not cuda:
        return KernelPlan(pad, out_dtype)
    inner_name, out_name = _GEMM_DIMS.get(gemm, ("the inner dim K", "the output dim N"))
    if n % align:
        raise ValueError(
            f"float8 gemm on CUDA needs {out_name} (here {n}) to be a multiple of 16"
            + (f" in the {gemm} gemm" if gemm else "")
            + ": keep this layer in hp (the default module filter does)"
        )
    if k % align and not pad:
        raise ValueError(
            f"float8 gemm on CUDA needs {inner_name} (here {k}) to be a multiple of 16"
            + (f" in the {gemm} gemm" if gemm else "")
            + ": set Float8LinearConfig.pad_inner_dim=True, or keep this layer in hp (the "
            "default module filter does)"
        )
    kernel_out = torch.bfloat16 if rowwise else out_dtype
    return KernelPlan(pad, kernel_out)


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
    _check_axes(a, b)
    out_dtype = out_dtype or a._orig_dtype
    a_data, b_data = a._data, b._data
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    if m == 0 or k == 0 or n == 0:
        # A sum over nothing is 0; cuBLAS has no business with empty operands.
        return torch.zeros((m, n), dtype=out_dtype, device=a_data.device)
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
    )
    if not _is_row_major(a_data):
        a_data = a_data.contiguous()
    if not _is_col_major(b_data):
        b_data = b_data.t().contiguous().t()
    if plan.pad_inner:
        a_data = _pad_to(a_data, 1, _CUDA_ALIGN)
        b_data = _pad_to(b_data.t(), 1, _CUDA_ALIGN).t()
    out = torch._scaled_mm(
        a_data,
        b_data,
        scale_a=inv_a,
        scale_b=inv_b,
        out_dtype=plan.kernel_out_dtype,
        use_fast_accum=use_fast_accum,
    )
    return out.to(out_dtype)
