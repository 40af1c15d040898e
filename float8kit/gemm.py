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

from float8kit import scaling, versions
from float8kit.config import GEMMS, Float8LinearConfig, Float8Recipe, GemmConfig
from float8kit.formats.blockwise import (  # noqa: F401  (block_kernel_plan: gemm's API too)
    block_kernel_plan,
    cuda_block_scales,
)
from float8kit.formats.blockwise import check_gemm as _check_blocks
from float8kit.formats.layout import CUDA_ALIGN as _CUDA_ALIGN
from float8kit.formats.layout import (  # noqa: F401  (KernelPlan, to_blocked: gemm's API too)
    GEMM_DIMS,
    KernelPlan,
    kernel_layouts,
    to_blocked,
)
from float8kit.formats.layout import pad_to as _pad_to
from float8kit.formats.mx import (  # noqa: F401  (mx_kernel_plan: gemm's API too)
    _mx_emulated_mm,
    mx_kernel_operands,
    mx_kernel_plan,
)
from float8kit.formats.mx import check_gemm as _check_mx
from float8kit.formats.nvfp4 import (  # noqa: F401  (nvfp4_kernel_plan: gemm's API too)
    _nvfp4_emulated_mm,
    nvfp4_kernel_operands,
    nvfp4_kernel_plan,
)
from float8kit.formats.nvfp4 import check_gemm as _check_nvfp4
from float8kit.tensor import Float8TrainingTensor

# what an sm90 GPU runs instead of mxfp8 (named in versions.require_mx_kernels' error)
_NOT_MX_RECIPES = ", ".join(
    r.value for r in Float8Recipe if r not in (Float8Recipe.MXFP8, Float8Recipe.NVFP4)
)


def _operand_scales(a: Float8TrainingTensor, b: Float8TrainingTensor, rowwise: bool):
    """Reciprocal scales shaped for ``_scaled_mm``: () and () or (M, 1) and (1, N)
    (``rowwise``: either operand is axiswise)."""
    inv_a = scaling.inverse(a._scale)
    inv_b = scaling.inverse(b._scale)
    if rowwise:
        # _scaled_mm takes both rowwise or both tensorwise; expanding a tensorwise scale to a
        # row/column vector is exact and lets rowwise_with_gw_hp mix the two.
        m, n = a.shape[0], b.shape[1]
        inv_a = inv_a.reshape(-1, 1).expand(m, 1).contiguous()
        inv_b = inv_b.reshape(1, -1).expand(1, n).contiguous()
        return inv_a, inv_b
    # A 0-d scale is left as is: reshape(()) of a 0-d DTensor fails sharding propagation.
    if inv_a.dim():
        inv_a = inv_a.reshape(())
    if inv_b.dim():
        inv_b = inv_b.reshape(())
    return inv_a, inv_b


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """What a layer's config fixes for one of its gemms (``gemm_plan``, made once per config),
    or a ``scaled_mm`` call's settings: calling it runs ``a @ b`` (``out_dtype`` default:
    ``a``'s hp dtype) on the operands' gemm family."""

    name: str | None
    use_fast_accum: bool = False
    emulate: bool = False
    pad_inner_dim: bool = False

    def __call__(self, a: Float8TrainingTensor, b: Float8TrainingTensor, out_dtype=None):
        return _family(a, b)(a, b, self, out_dtype or a._orig_dtype)


def kernel_plan(
    k: int, n: int, out_dtype: torch.dtype, cuda: bool, rowwise: bool, gemm: GemmPlan
) -> KernelPlan:
    """Padding and kernel output dtype of an (M, K) @ (K, N) float8 gemm; raises when the
    device's kernel cannot run it.

    CUDA (cuBLAS) needs K and N to be multiples of 16. N is a layer dim: when it is not
    aligned the layer must stay hp. K is zero-padded when ``gemm.pad_inner_dim`` is set, and
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
        gemm: the gemm's settings: ``name``, ``"output"``, ``"grad_input"`` or
            ``"grad_weight"`` when known (messages, and the grad_weight gemm's automatic
            padding), ``pad_inner_dim`` (``Float8LinearConfig.pad_inner_dim``) and
            ``use_fast_accum`` (CUDA routing).
    """
    align, name, pad_dims = _CUDA_ALIGN, gemm.name, gemm.pad_inner_dim
    pad = -k % align if pad_dims or (cuda and name == "grad_weight") else 0
    pad_out = -n % align if pad_dims else 0
    if not cuda:
        return KernelPlan(pad, out_dtype, pad_out)
    inner_name, out_name = GEMM_DIMS.get(name, ("the inner dim K", "the output dim N"))
    for dim, size, padded in ((out_name, n, pad_out), (inner_name, k, pad)):
        if size % align and not padded:
            raise ValueError(
                f"float8 gemm on CUDA needs {dim} (here {size}) to be a multiple of 16"
                + (f" in the {name} gemm" if name else "")
                + ": set Float8LinearConfig.pad_inner_dim=True, or keep this layer in hp (the "
                "default module filter does)"
            )
    if rowwise and not gemm.use_fast_accum:
        return KernelPlan(pad, torch.float32, pad_out, post_scale=True)
    kernel_out = torch.bfloat16 if rowwise else out_dtype
    return KernelPlan(pad, kernel_out, pad_out)


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
    if emulate or not a._data.is_cuda:
        return a._gran.emulated_mm(a, b).to(out_dtype)
    inv_a = scaling.inverse(a._scale)
    inv_b = scaling.inverse(b._scale)
    out = _kernel_block_mm(a._data, b._data, inv_a, inv_b, a._block, b._block, gemm)
    return out.to(out_dtype)


def _kernel_block_mm(a_data, b_data, inv_a, inv_b, block_a, block_b, gemm) -> torch.Tensor:
    """The CUDA kernel call (bf16 out); on the meta device it checks the layouts without a
    GPU (torch's meta function mirrors the kernel's checks)."""
    (m, k), n = a_data.shape, b_data.shape[1]
    plan = block_kernel_plan(m, k, n, block_a, block_b, gemm)
    inv_a, inv_b = cuda_block_scales(inv_a, inv_b, plan)
    a_data, b_data = kernel_layouts(a_data, b_data)
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
        return a._gran.emulated_mm(a, b).to(out_dtype)
    versions.require_mx_kernels(a._data.device, "Float8LinearConfig", _NOT_MX_RECIPES)
    a_data, b_data, scale_a, scale_b = mx_kernel_operands(a, b, gemm)
    out = _kernel(a_data, b_data, scale_a, scale_b, torch.bfloat16, False)
    return out.to(out_dtype)


# ---------------------------------------------------------------------------- NVFP4


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
        return a._gran.emulated_mm(a, b).to(out_dtype)
    versions.require_mx_kernels(
        a._data.device, "Float8LinearConfig", _NOT_MX_RECIPES, "the nvfp4 recipe's gemms", "NVFP4"
    )
    a_fp4, b_fp4, scale_a, scale_b, tensor_scale = nvfp4_kernel_operands(a, b, gemm)
    out = _kernel(a_fp4, b_fp4, scale_a, scale_b, torch.float32, False)
    # cuBLAS applies the block scales; the tensor scales multiply the fp32 result once
    return (out * tensor_scale).to(out_dtype)


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
    return GemmPlan(gemm, use_fast_accum, emulate, pad_inner_dim)(a, b, out_dtype)


def _family(a: Float8TrainingTensor, b: Float8TrainingTensor):
    """The gemm of the operands' family (a format's capability), after the shape check; a
    tensorwise operand joins the other's family, whose operand check then says what does
    not match."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"scaled_mm needs (M, K) @ (K, N); got {tuple(a.shape)} @ {tuple(b.shape)}"
        )
    family = a._gran.capabilities.gemm
    if family == "scaled":
        family = b._gran.capabilities.gemm
    return _FAMILIES[family]


_CONFIG_FIELD = {g.name: g.config_field for g in GEMMS}


def gemm_plan(config: Float8LinearConfig, name: str | None) -> GemmPlan:
    """The plan of the gemm ``name`` (``config.GEMMS``) of a layer with ``config``; None: a
    gemm of no layer (default settings)."""
    settings = getattr(config, _CONFIG_FIELD[name]) if name else GemmConfig()
    return GemmPlan(name, settings.use_fast_accum, config.emulate, config.pad_inner_dim)


def _empty(a: Float8TrainingTensor, b: Float8TrainingTensor, out_dtype: torch.dtype):
    """Zeros for an empty product (M, K or N is 0: a sum over nothing is 0; cuBLAS has no
    business with empty operands), else None."""
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    if m == 0 or k == 0 or n == 0:
        return torch.zeros((m, n), dtype=out_dtype, device=a._data.device)
    return None


def _tensor_or_row_scaled_mm(a, b, gemm: GemmPlan, out_dtype: torch.dtype):
    """The ``scaled`` family: tensorwise and axiswise operands, ``torch._scaled_mm``."""
    rowwise = a._gran.axiswise_dim is not None or b._gran.axiswise_dim is not None
    if rowwise:
        _check_axes(a, b)
    if (zeros := _empty(a, b, out_dtype)) is not None:
        return zeros
    a_data, b_data = a._data, b._data
    k, n = a_data.shape[1], b_data.shape[1]
    inv_a, inv_b = _operand_scales(a, b, rowwise)

    if gemm.emulate:
        out = (a_data.to(torch.float32) @ b_data.to(torch.float32)) * inv_a * inv_b
        return out.to(out_dtype)

    plan = kernel_plan(k, n, out_dtype, a_data.is_cuda, rowwise, gemm)
    a_data, b_data = kernel_layouts(a_data, b_data)
    if plan.pad_inner:
        a_data = _pad_to(a_data, 1, _CUDA_ALIGN)
        b_data = _pad_to(b_data.t(), 1, _CUDA_ALIGN).t()
    if plan.pad_out:
        b_data = _pad_to(b_data.t(), 0, _CUDA_ALIGN).t()  # zero columns, still column-major
        if inv_b.dim() == 2:
            inv_b = F.pad(inv_b, (0, plan.pad_out), value=1.0)
    kernel = _kernel if a_data.is_cuda else _cpu_kernel
    scales = (inv_a.new_ones(()),) * 2 if plan.post_scale else (inv_a, inv_b)
    out = kernel(a_data, b_data, *scales, plan.kernel_out_dtype, gemm.use_fast_accum)
    if plan.post_scale:
        out = out * inv_a * inv_b
    if plan.pad_out:
        out = out[:, :n]
    return out if out.dtype == out_dtype else out.to(out_dtype)


def tensorwise_data_mm(a, b, inv_a, inv_b, out_dtype: torch.dtype, use_fast_accum: bool):
    """``a @ b`` of tensorwise float8 data (2-D, any layouts, 0-d reciprocal scales) in eager
    (``versions.eager_direct``): the scaled family's kernel call for such operands where no
    dim needs padding (``direct_dims``)."""
    a, b = kernel_layouts(a, b)
    kernel = _kernel if a.is_cuda else _cpu_scaled_mm
    return kernel(a, b, inv_a, inv_b, out_dtype, use_fast_accum)


def direct_dims(m: int, k: int, n: int, cuda: bool) -> bool:
    """Whether a layer's three tensorwise gemms on (M, K) tokens and an (N, K) weight run
    without padding (``kernel_plan``): always on CPU; on CUDA when M, K and N are multiples
    of 16 (else the scaled family pads the grad_weight gemm's K or raises)."""
    return not cuda or (m % _CUDA_ALIGN == 0 and k % _CUDA_ALIGN == 0 and n % _CUDA_ALIGN == 0)


def _block_family(gemm_of):
    """A block-scaled family's gemm, ``gemm_of()`` (a lambda naming the module function, so
    a test that wraps the function sees its calls): no fast accumulation, no inner-dim
    padding flag (its kernel plan pads what it must), empty products first."""

    def run(a, b, gemm: GemmPlan, out_dtype: torch.dtype):
        if (zeros := _empty(a, b, out_dtype)) is not None:
            return zeros
        return gemm_of()(a, b, emulate=gemm.emulate, out_dtype=out_dtype, gemm=gemm.name)

    return run


# every format's gemm family (``Capabilities.gemm``) -> its gemm
_FAMILIES = {
    "scaled": _tensor_or_row_scaled_mm,
    "block": _block_family(lambda: block_scaled_mm),
    "mx": _block_family(lambda: mx_scaled_mm),
    "nvfp4": _block_family(lambda: nvfp4_scaled_mm),
}


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


def _cpu_scaled_mm(
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


# torch.library's low-level API, not ``custom_op`` (see float8kit::cast_tensorwise)
_LIB = torch.library.Library("float8kit", "FRAGMENT")
_LIB.define(
    "cpu_scaled_mm(Tensor a, Tensor b, Tensor inv_a, Tensor inv_b, ScalarType out_dtype, "
    "bool use_fast_accum) -> Tensor"
)
_LIB.impl("cpu_scaled_mm", _cpu_scaled_mm, "CompositeExplicitAutograd")
_cpu_kernel_op = torch.ops.float8kit.cpu_scaled_mm.default


def _cpu_kernel(a, b, inv_a, inv_b, out_dtype, use_fast_accum):
    """``float8kit::cpu_scaled_mm``; in eager (``versions.eager_direct``) its body, called
    without the custom op's dispatcher and autograd round trips."""
    op = _cpu_scaled_mm if versions.eager_direct() else _cpu_kernel_op
    return op(a, b, inv_a, inv_b, out_dtype, use_fast_accum)


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


@torch.library.register_fake("float8kit::cpu_scaled_mm")
def _(a, b, inv_a, inv_b, out_dtype, use_fast_accum):
    return a.new_empty((a.size(0), b.size(1)), dtype=out_dtype)
