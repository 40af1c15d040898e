"""The float8 grouped gemms of MoE experts: the one place that calls
``torch._scaled_grouped_mm`` (``_grouped_kernel``), for rowwise operands
(``scaled_grouped_mm``) and MXFP8 ones (``mx_scaled_grouped_mm``), over jagged token groups
(``offs``, as ``torch._grouped_mm`` takes them), and their CPU emulations, which are opaque
ops to ``torch.compile`` (``float8kit::emulated_grouped_mm``, ``emulated_mx_grouped_mm``).
The CUDA kernels want token groups aligned (16 rows for rowwise, 32 for MX): padded here on
the device, from ``offs``, without a host sync (``token_group_padding``).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from float8kit import scaling, versions
from float8kit.formats import MX
from float8kit.formats.layout import is_row_major
from float8kit.gemm import _CUDA_ALIGN, to_blocked


@torch.library.custom_op("float8kit::grouped_mm_fp32", mutates_args=())
def _grouped_mm_fp32(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` of fp32 operands, an opaque op to ``torch.compile``: the eager
    kernel takes fp32 (the emulation's exact products of float8 values, fp32 sums), but its
    meta function accepts bf16 only, so a compiled graph could not trace it directly. CUDA's
    grouped kernel takes bf16 only: there, one matmul per group (emulation is for debugging)."""
    if a.device.type == "cpu":
        out = torch._grouped_mm(a, b, offs=offs)
        if b.dim() == 3:  # rows past offs[-1], in no group, are left unwritten: zeros
            in_group = token_groups(offs, a.size(0)) < offs.numel()
            out = torch.where(in_group.unsqueeze(1), out, 0.0)
        return out
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:
        out = a.new_zeros((a.size(0), b.size(-1)))
        for g, (lo, hi) in enumerate(zip(starts, ends, strict=True)):
            out[lo:hi] = a[lo:hi] @ b[g]
        return out
    return torch.stack([a[:, lo:hi] @ b[lo:hi] for lo, hi in zip(starts, ends, strict=True)])


def hp_grad_weight(x: torch.Tensor, grad_output: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """An expert layer's weight gradient in hp, (G, K, N): per token group ``x.T @
    grad_output``, as ``torch._grouped_mm(grad_output.T, x)`` transposed (torchao's order, so
    the bits of its ``mxfp8_rceil_wgrad_with_hp``). torch's grouped kernel (and its meta,
    under ``torch.compile``) takes bf16 only: other dtypes run it in fp32 (exact products,
    fp32 sums; ``float8kit::grouped_mm_fp32``) and round to ``x``'s dtype."""
    a, b = grad_output.t(), x
    if a.dtype == b.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs).transpose(-2, -1)
    if a.is_cuda:
        warnings.warn(
            f"float8kit: the experts' hp weight gradient in {x.dtype} on CUDA runs one matmul "
            "per expert after a host sync (torch's grouped kernel takes bf16 only): train "
            "under torch.autocast(dtype=torch.bfloat16), or with bf16 expert weights",
            stacklevel=2,
        )
    out = _grouped_mm_fp32(a.float(), b.float(), offs).transpose(-2, -1)
    return out.to(torch.promote_types(x.dtype, grad_output.dtype))


def _out_shape(a, b, offs) -> tuple[int, ...]:
    """A grouped gemm's result: (M, N) for 2-D x 3-D, (G, M, N) for 2-D x 2-D."""
    return (a.size(0), b.size(-1)) if b.dim() == 3 else (offs.size(0), a.size(0), b.size(1))


def token_groups(offs: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The group of each of ``num_tokens`` rows: ``g`` for rows ``offs[g-1]:offs[g]``,
    ``len(offs)`` for rows past ``offs[-1]`` (which grouped gemms ignore)."""
    rows = torch.arange(num_tokens, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, rows, right=True)


_grouped_mm_fp32.register_fake(lambda a, b, offs: a.new_empty(_out_shape(a, b, offs)))


def token_group_padding(
    offs: torch.Tensor, num_tokens: int, align: int = _CUDA_ALIGN
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each of ``num_tokens`` rows (sorted by group, ``offs`` the int32 cumulative group
    ends) goes when every group is padded to a multiple of ``align`` rows: the CUDA grouped
    gemms want each group to start at a multiple of 16 rows and the jagged dim's stride
    16-byte aligned. A pure function of ``offs``, no host sync.

    Each group gets ``ceil(count / align) * align`` rows, at least ``align`` (an empty
    expert gets ``align`` zero rows: the kernel never sees an empty group, and its gemm sums
    zeros: exact zeros). Rows past ``offs[-1]`` keep their distance from the last group's
    end. The padded row count is a static bound, ``num_tokens + align * G`` rounded up to
    ``align``, so shapes do not depend on the routing (one compiled graph).

    Returns:
        ``dest`` (num_tokens,) int64: each row's index in the padded tensor; the padded
        ``offs`` (G,) in ``offs``' dtype; the padded row count.
    """
    ends = offs.to(torch.int64)
    starts = F.pad(ends[:-1], (1, 0))
    counts = (ends - starts + align - 1) // align * align
    padded_ends = counts.clamp(min=align).cumsum(0)
    padded_starts = F.pad(padded_ends[:-1], (1, 0))
    shift = torch.cat([padded_starts - starts, padded_ends[-1:] - ends[-1:]])
    total = -(-(num_tokens + align * offs.numel()) // align) * align
    dest = torch.arange(num_tokens, device=offs.device) + shift[token_groups(ends, num_tokens)]
    return dest, padded_ends.to(offs.dtype), total


def _scatter_rows(t: torch.Tensor, dest: torch.Tensor, rows: int) -> torch.Tensor:
    """``t``'s rows at ``dest`` of a ``rows``-row tensor of zeros (on the bytes: float8 dtypes
    lack index kernels on some devices; a zero byte is +0.0)."""
    if t.dtype.itemsize != 1:
        return t.new_zeros((rows, *t.shape[1:])).index_copy(0, dest, t)
    out = torch.zeros((rows, *t.shape[1:]), dtype=torch.uint8, device=t.device)
    return out.index_copy(0, dest, t.view(torch.uint8)).view(t.dtype)


def _grouped_mm_aligned(a, a_scale, b, b_scale, offs, **kwargs) -> torch.Tensor:
    """``scaled_grouped_mm`` with every token group padded to a multiple of 16 rows (see
    ``token_group_padding``): zero rows add nothing to any sum, so the result is unchanged."""
    if b.dim() == 3:  # groups along a's rows: scatter them, gather the output's
        dest, padded_offs, rows = token_group_padding(offs, a.size(0))
        a = _scatter_rows(a, dest, rows)
        a_scale = a_scale.new_ones((rows,)).index_copy(0, dest, a_scale.reshape(-1))
        out = scaled_grouped_mm(a, a_scale, b, b_scale, padded_offs, **kwargs)
        return out[dest]
    # groups along the inner dim T: a (M, T) and b (T, N) get the same zero rows of T
    dest, padded_offs, rows = token_group_padding(offs, a.size(1))
    a = _scatter_rows(a.t(), dest, rows).t()
    b = _scatter_rows(b, dest, rows)
    return scaled_grouped_mm(a, a_scale, b, b_scale, padded_offs, **kwargs)


def scaled_grouped_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    offs: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    emulate: bool = False,
    use_fast_accum: bool = False,
    align_groups: bool | None = None,
) -> torch.Tensor:
    """The one place that calls ``torch._scaled_grouped_mm``: a float8 grouped gemm over
    jagged groups (MoE experts), with rowwise scales.

    Shapes (G groups, ``offs`` the int32 cumulative group ends, as for ``torch._grouped_mm``):

    - 2-D x 3-D (an expert layer's output and grad_input gemms): ``a`` (M, K) split along M,
      ``a_scale`` (M,) one per row; ``b`` (G, K, N), ``b_scale`` (G, N) one per expert
      column; the result is (M, N).
    - 2-D x 2-D (the weight-gradient gemm): ``a`` (M, T) and ``b`` (T, N) split along the
      inner dim T; ``a_scale`` (G * M,) one per group and row, ``b_scale`` (G * N,) one per
      group and column; the result is (G, M, N). An empty group gives exact zeros.

    Scales multiply (``fp8 = hp * scale``, float8kit's convention); the kernel gets their
    reciprocals. The numerics are the CUDA kernel's: products of float8 values accumulated
    in fp32 per group, times ``1 / (scale_a * scale_b)``, written as bf16 (the kernel's only
    output dtype), then cast to ``out_dtype``. ``emulate`` (and every non-CUDA tensor, since
    torch has no CPU kernel) computes exactly that with ``torch._grouped_mm`` in fp32; rows
    of ``a`` past ``offs[-1]`` come out as zeros there (the kernel leaves them unwritten).

    Args:
        a, b: ``torch.float8_e4m3fn`` data (the kernel takes e4m3 only).
        a_scale, b_scale: fp32 multiplying scales in the shapes above.
        offs: (G,) int32 cumulative group ends.
        out_dtype: dtype of the result.
        emulate: do the math in fp32 instead of calling the kernel.
        use_fast_accum: the kernel's faster, less precise accumulation (CUDA only).
        align_groups: pad every token group to a multiple of 16 rows first (zero rows, the
            same result; ``token_group_padding``). Default: where the CUDA kernel runs,
            which needs it.

    Returns:
        The grouped product in ``out_dtype``.
    """
    if align_groups is None:
        align_groups = a.is_cuda and not emulate
    if align_groups:
        return _grouped_mm_aligned(
            a, a_scale, b, b_scale, offs, out_dtype=out_dtype, emulate=emulate,
            use_fast_accum=use_fast_accum, align_groups=False,
        )  # fmt: skip
    inv_a, inv_b = scaling.inverse(a_scale), scaling.inverse(b_scale)
    if a.is_cuda and not emulate:
        out = _grouped_kernel(a, b, inv_a.contiguous(), inv_b.contiguous(), offs, use_fast_accum)
        return out.to(out_dtype)
    return _emulated_grouped_mm(a, inv_a, b, inv_b, offs).to(out_dtype)


@torch.library.custom_op("float8kit::emulated_grouped_mm", mutates_args=())
def _emulated_grouped_mm(
    a: torch.Tensor, inv_a: torch.Tensor, b: torch.Tensor, inv_b: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """The grouped kernel's numerics in fp32 (see ``scaled_grouped_mm``), bf16 out; an opaque
    op to ``torch.compile``, so compiled is bitwise eager on every torch (torch 2.11's
    inductor drops the bf16 rounding of an fp32 -> bf16 -> fp32 round trip)."""
    acc = _grouped_mm_fp32(a.to(torch.float32), b.to(torch.float32), offs)
    if b.dim() == 3:
        groups, m = b.size(0), a.size(0)
        group = token_groups(offs, m)  # rows past offs[-1] get G, an extra all-zero scale row
        inv_b = torch.cat([inv_b, inv_b.new_zeros((1, inv_b.size(1)))])[group]
        out = acc * inv_a.reshape(m, 1) * inv_b
        out = torch.where((group < groups).unsqueeze(1), out, 0.0)
    else:
        groups = offs.size(0)
        out = acc * inv_a.reshape(groups, -1, 1) * inv_b.reshape(groups, 1, -1)
    return out.to(torch.bfloat16)


def _bf16_fake(a, a_scale, b, b_scale, offs):
    return a.new_empty(_out_shape(a, b, offs), dtype=torch.bfloat16)


_emulated_grouped_mm.register_fake(_bf16_fake)


# ---------------------------------------------------------------------------- MX grouped


def pad_token_groups(
    t: torch.Tensor, offs: torch.Tensor, align: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t``'s rows (sorted by group, ``offs`` the cumulative group ends) with every group
    zero-padded to a multiple of ``align`` rows (``token_group_padding``, no host sync).

    Returns:
        The padded rows, the padded ``offs``, and ``dest`` (each row's index in the padded
        tensor: ``padded[dest]`` gives ``t`` back).
    """
    dest, padded_offs, rows = token_group_padding(offs, t.size(0), align)
    return _scatter_rows(t, dest, rows), padded_offs, dest


def _blocked_m_groups(scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """An (M, KB) MX scale of token groups along M (each a multiple of 32 rows) in the
    kernel's per-group blocked layout: each group's rows padded to a multiple of 128 and
    laid out by ``to_blocked``, the groups one after another (torchao's
    ``torch_to_blocked_2d_M_groups``). Groups of whole 128-row tiles make that one
    ``to_blocked`` of the scattered rows; no host sync. Returns (rows, round_up(KB, 4))."""
    padded, _, _ = pad_token_groups(scale, offs, 128)
    return to_blocked(padded).view(padded.size(0), -1)


def _blocked_k_groups(scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """An (M, TB) MX scale whose 32-blocks run along the jagged token dim (T / 32 blocks,
    groups along it: ``offs`` // 32) in the kernel's layout for the 2-D x 2-D gemm: each
    group's columns padded to a multiple of 4 and laid out by ``to_blocked`` (row tiles
    first within the group), the groups one after another (torchao's
    ``torch_to_blocked_2d_K_groups``). The 128 x 4 tiles are moved by computed indices, no
    host sync. Returns (round_up(M, 128), padded columns)."""
    col_offs = offs // 32
    cols, padded_offs, _ = pad_token_groups(scale.t(), col_offs, 4)
    x = cols.t()  # (M, TBp): each group's columns start at a multiple of 4
    m, width = x.shape
    hb, wb = -(-m // 128), width // 4
    tiles = to_blocked(x).view(hb, wb, 512)  # row tiles first, over the whole width
    # tile (r, c) of group g (its column tiles [s, e)) goes to s * hb + r * (e - s) + (c - s);
    # the columns past the last group are one more group
    ends = torch.cat([padded_offs.to(torch.int64) // 4, padded_offs.new_full((1,), wb)])
    starts = F.pad(ends[:-1], (1, 0))
    c = torch.arange(wb, device=x.device)
    g = torch.searchsorted(ends, c, right=True).clamp(max=ends.numel() - 1)
    s, e = starts[g], ends[g]
    r = torch.arange(hb, device=x.device).unsqueeze(1)
    dest = s * hb + r * (e - s) + (c - s)
    out = torch.empty_like(tiles.view(-1, 512)).index_copy(0, dest.reshape(-1), tiles.view(-1, 512))
    return out.view(hb * 128, width)


def mx_scaled_grouped_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    offs: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    emulate: bool = False,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """The MXFP8 grouped gemm (MoE experts): e4m3 operands with one e8m0 scale byte per 32
    elements along the inner dim (``formats.mx.to_mx``'s uint8 scales, shaped like the data with
    that dim reduced to ceil(n / 32)).

    Shapes (G groups, ``offs`` the int32 cumulative group ends):

    - 2-D x 3-D (output and grad_input): ``a`` (M, K) split along M, ``a_scale`` (M, K / 32);
      ``b`` (G, K, N), ``b_scale`` (G, K / 32, N); result (M, N). K a multiple of 32.
    - 2-D x 2-D (grad_weight): ``a`` (M, T) and ``b`` (T, N) split along the token dim T,
      ``a_scale`` (M, T / 32), ``b_scale`` (T / 32, N); every group a multiple of 32 tokens
      (``pad_token_groups``: a 32-block must not straddle two experts); result (G, M, N).

    CUDA (SM100; an older GPU raises ``versions.require_mx_kernels``' error before any
    kernel): ``torch._scaled_grouped_mm`` with the scales as ``torch.float8_e8m0fnu`` in
    the kernel's blocked layouts (per group for the 2-D operands, per expert for the 3-D
    one), token groups of the 2-D x 3-D gemm padded to 32 rows (zeros, no host sync), bf16
    out. Elsewhere, and with ``emulate``: both operands dequantized to fp32 (exact), the fp32
    grouped gemm, written as bf16 like the kernel (``float8kit::emulated_mx_grouped_mm``);
    rows of ``a`` past ``offs[-1]`` come out as zeros.
    """
    if not (a.is_cuda and not emulate):
        return _emulated_mx_grouped_mm(a, a_scale, b, b_scale, offs).to(out_dtype)
    versions.require_mx_kernels(a.device, "Float8ExpertsConfig", "rowwise, the default")
    e8m0 = torch.float8_e8m0fnu
    if b.dim() == 3:
        groups, k, n = b.shape
        if k % 32 or n % _CUDA_ALIGN:
            raise ValueError(
                f"MX grouped gemm on CUDA needs the expert weight's inner dim (here {k}) to be "
                f"a multiple of 32 and its output dim (here {n}) of 16: keep this weight in hp "
                "(param_filter_fn of convert_experts_to_float8_training)"
            )
        a_pad, offs_pad, dest = pad_token_groups(a, offs, 32)
        scale_pad, _, _ = pad_token_groups(a_scale, offs, 32)
        scale_a = _blocked_m_groups(scale_pad, offs_pad)
        # per expert: its (N, K / 32) scales blocked, N padded to whole 128-row tiles
        per_expert = F.pad(b_scale.transpose(1, 2), (0, 0, 0, -n % 128))
        scale_b = to_blocked(per_expert.reshape(-1, per_expert.size(-1))).view(groups, -1)
        out = _grouped_kernel(
            a_pad, b, scale_a.view(e8m0), scale_b.view(e8m0), offs_pad, use_fast_accum
        )
        return out[dest].to(out_dtype)
    scale_a = _blocked_k_groups(a_scale, offs)
    scale_b = _blocked_k_groups(b_scale.t(), offs)
    out = _grouped_kernel(a, b, scale_a.view(e8m0), scale_b.view(e8m0), offs, use_fast_accum)
    return out.to(out_dtype)


def _grouped_kernel(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """The one ``torch._scaled_grouped_mm`` call (bf16 out, its only output dtype): A
    row-major, B column-major; fp32 reciprocal rowwise scales, or e8m0 MX scales in the
    kernel's blocked layouts."""
    if not is_row_major(a):
        a = a.contiguous()
    if not (b.stride(-2) == 1 and b.stride(-1) >= b.size(-2)):
        b = b.transpose(-2, -1).contiguous().transpose(-2, -1)  # column-major
    return torch._scaled_grouped_mm(
        a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum
    )


@torch.library.custom_op("float8kit::emulated_mx_grouped_mm", mutates_args=())
def _emulated_mx_grouped_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    offs: torch.Tensor,
) -> torch.Tensor:
    """The MX grouped kernel's numerics in fp32 (see ``mx_scaled_grouped_mm``), bf16 out; an
    opaque op to ``torch.compile`` (and one that counts as an MX expert gemm)."""
    # both dequantized to fp32 (exact): blocks along K, b's along its dim -2 (K, or tokens)
    # (rows past offs[-1]: zeros, as _grouped_mm_fp32 writes them)
    acc = _grouped_mm_fp32(
        MX(1).dequantize(a, a_scale), MX(b.dim() - 2).dequantize(b, b_scale), offs
    )
    return acc.to(torch.bfloat16)


_emulated_mx_grouped_mm.register_fake(_bf16_fake)
