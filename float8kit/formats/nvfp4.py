"""NVFP4: e2m1 elements, one e4m3 scale per 16, one fp32 scale per tensor.

The format object (``NVFP4``, its layout and capabilities) and the math of an NVFP4 cast in
torch ops: the CPU reference, and what every device runs up to the gemm
(float8kit.gemm.nvfp4_scaled_mm packs it for the CUDA kernel).

Two-level scaling (NVIDIA's recipe, torchao 0.18's ``nvfp4_quantize`` with a per-tensor
scale): the tensor scale is ``tensor_scale(amax) = amax / (448 * 6)`` (a decode scale:
values ~ e2m1 * block_scale * tensor_scale); each block's scale is
``e4m3(clamp(block_amax / 6 / tensor_scale, 2**-6, 448))`` (round to nearest even); the
elements are ``x * ((1 / tensor_scale) / block_scale)``, clamped to +-6 and rounded to the
e2m1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} (``round_nearest``: to nearest, ties to the even code,
bitwise torchao's ``f32_to_f4_unpacked``; ``round_stochastic``: up with probability the
distance to the grid point below over the gap, unbiased).

Codes are uint8, one per element, the e2m1 bits in the low nibble (sign in bit 3); a gemm
packs them two per byte (``pack``: the even index in the low nibble, as torch's
``float4_e2m1fn_x2`` and torchao's ``pack_uint4``).

Random Hadamard transform (``hadamard``): the grad_weight gemm reduces the token dim; both
of its operands are multiplied along it, in blocks of 16 rows, by one orthogonal 16 x 16
matrix ``Q = diag(RHT_SIGNS) @ H16 / 4`` (Sylvester Hadamard, fixed random signs), so that
``(Q g)^T (Q x) = g^T x`` exactly in real arithmetic while outliers spread over their block
before the cast. A partial last block (a token count not a multiple of 16) is left as is, in
both operands alike.

Non-finite values stay visible: a NaN makes the tensor amax NaN and every block scale NaN;
an inf makes its blocks' scales NaN (inf / inf) and the other blocks 0. Either way the gemm
gives NaN where they enter (e2m1 has no inf or NaN of its own). A tensor whose amax is 0 (or
below 2**-100, where ``1 / (tensor_scale * 2**-6)`` would overflow fp32) gets tensor scale 1:
all its codes are 0 (torchao's reference divides by a zero scale there and gives NaN).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.nn.functional as F

from float8kit import scaling, versions
from float8kit.config import E4M3, NVFP4_BLOCK, GemmRole, ScalingType
from float8kit.formats.base import (
    Capabilities,
    Format,
    WholeBlocks,
    check_one_dim_mesh,
    refill_scale,
    split_flat,
)
from float8kit.formats.layout import KernelPlan, k32_plan, pad_to, to_blocked

E2M1_MAX = 6.0
E4M3_MAX = 448.0
# the smallest block scale (e4m3's smallest normal): torchao's E4M3_EPS
_BLOCK_SCALE_MIN = 2.0**-6
# below this amax the tensor scale is 1 (see the module docstring)
_AMAX_FLOOR = 2.0**-100
# The Hadamard transform's signs: one fixed draw (not per layer, not per step), so that every
# rank and every resumed run transforms alike and nothing needs saving.
RHT_SIGNS = (1, -1, 1, 1, -1, 1, -1, -1, 1, 1, 1, -1, -1, -1, 1, -1)


def tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 per-tensor decode scale ``amax / (448 * 6)``; 1 where ``amax < 2**-100``."""
    amax = amax.to(torch.float32)
    # (NaN < floor is False: a NaN amax gives a NaN scale, never 1)
    return torch.where(amax < _AMAX_FLOOR, 1.0, amax / (E4M3_MAX * E2M1_MAX))


def block_scale(block_amax: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """Each block's e4m3 scale (as fp32 values) under the ``tensor`` decode scale."""
    scaled = (block_amax / E2M1_MAX) / tensor
    return torch.clamp(scaled, min=_BLOCK_SCALE_MIN, max=E4M3_MAX).to(E4M3).to(torch.float32)


def round_nearest(q: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8) of fp32 ``q`` already in [-6, 6]: to nearest, ties to the even
    code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); -0 and
    values that round to 0 from below keep the sign bit."""
    a = q.abs()
    steps = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return steps | (torch.signbit(q).to(torch.uint8) << 3)


def round_stochastic(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8) of fp32 ``q`` already in [-6, 6], rounded stochastically with the
    uniform [0, 1) draws ``u`` (same shape): between the grid points lo <= |q| <= hi, hi when
    ``u < (|q| - lo) / (hi - lo)``, so the expected value is ``q`` exactly. The gap is 0.5
    below 2, 1 below 4, 2 up to 6 (powers of two: the probability is exact in fp32)."""
    a = q.abs()
    gap = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    low = torch.floor(a / gap) * gap
    up = (u < (a - low) / gap).to(torch.float32)
    # on the grid now: round_nearest encodes it exactly
    return round_nearest(torch.copysign(low + gap * up, q))


def decode(codes: torch.Tensor) -> torch.Tensor:
    """The fp32 values of e2m1 ``codes``."""
    c = codes.to(torch.int32)
    exponent, mantissa = (c >> 1) & 3, (c & 1).to(torch.float32)
    normal = torch.exp2((exponent - 1).to(torch.float32)) * (1.0 + 0.5 * mantissa)
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, normal)
    return torch.where((c & 8) != 0, -magnitude, magnitude)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes two per byte along the last dim (even: low nibble): ``float4_e2m1fn_x2``'s
    bytes, last dim halved (it must be even)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def hadamard_matrix(device: torch.device | str | None = None) -> torch.Tensor:
    """``Q = diag(RHT_SIGNS) @ H16 / 4``, fp32, orthogonal (Q^T Q = I)."""
    h = torch.ones((1, 1), dtype=torch.float32, device=device)
    while h.shape[0] < NVFP4_BLOCK:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float32, device=device)
    return signs[:, None] * h / 4.0


def hadamard(x: torch.Tensor, dim: int, *, inverse: bool = False) -> torch.Tensor:
    """fp32 ``Q`` applied along ``dim`` of 2-D ``x`` to every whole 16-block (``Q^T`` with
    ``inverse``); a partial last block stays as it is."""
    x = x.to(torch.float32)
    if dim == 1:
        return hadamard(x.t(), 0, inverse=inverse).t()
    whole = x.shape[0] - x.shape[0] % NVFP4_BLOCK
    q = hadamard_matrix(x.device)
    if inverse:
        q = q.t()
    blocks = x[:whole].reshape(whole // NVFP4_BLOCK, NVFP4_BLOCK, x.shape[1])
    # in fp32 under autocast too (whose matmul would run it in bf16/fp16: an fp16 block of
    # large values overflows)
    with (
        torch.autocast(x.device.type, enabled=False)
        if torch.is_autocast_enabled(x.device.type)
        else contextlib.nullcontext()
    ):
        out = torch.matmul(q, blocks).reshape(whole, x.shape[1])
    return torch.cat([out, x[whole:]]) if whole < x.shape[0] else out


def quantize(
    hp: torch.Tensor,
    block: tuple[int, int],
    *,
    hadamard_dim: int | None = None,
    stochastic: bool = False,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The NVFP4 cast of 2-D ``hp`` in ``block``-shaped scale blocks ((1, 16), (16, 1), (16,
    16)): ``(codes, scale)``. ``codes``: uint8 of ``hp``'s shape; ``scale``: fp32 (2, R / br,
    C / bc) (rounded up), ``scale[0]`` the block scales' e4m3 values, ``scale[1]`` the tensor
    scale in every place (``NVFP4``). ``hadamard_dim``: transform along that dim
    first (``hadamard``); the amaxes are the transformed values'. ``stochastic``: round the
    elements stochastically with fresh draws from torch's generator (``torch.rand``),
    otherwise to nearest. ``scale``: cast with this scale (a redo of an earlier cast of the
    same ``hp``, bitwise its codes when rounding to nearest) instead of the amaxes'."""
    x = hp.to(torch.float32)
    if hadamard_dim is not None:
        x = hadamard(x, hadamard_dim)
    if scale is None:
        tensor = tensor_scale(scaling.amax(x))
        blocks = block_scale(scaling.block_amax(x, block), tensor)
        scale = torch.stack([blocks, tensor.expand_as(blocks)])
    # torchao's order: x * ((1 / tensor_scale) / block_scale), one fp32 factor per block
    factor = (1.0 / scale[1]) / scale[0]
    blocked = scaling.blocked(x, block)  # (R / br, br, C / bc, bc), zero-padded
    q = torch.clamp(blocked * factor[:, None, :, None], -E2M1_MAX, E2M1_MAX)
    if stochastic:
        codes = round_stochastic(q, torch.rand(q.shape, dtype=torch.float32, device=q.device))
    else:
        codes = round_nearest(q)
    r, c = hp.shape
    codes = codes.reshape(blocked.shape[0] * blocked.shape[1], -1)
    if codes.shape != (r, c):
        codes = codes[:r, :c].contiguous()
    return codes, scale


def values(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The fp32 values NVFP4 ``codes`` with ``scale`` stand for (in the transformed domain of
    a Hadamard cast): ``e2m1 * (block_scale * tensor_scale)``, torchao's dequantization."""
    per_block = scale[0] * scale[1]
    return decode(codes) * scaling.expand_block_scale(per_block, block, codes.shape)


@dataclasses.dataclass(frozen=True)
class NVFP4(WholeBlocks, Format):
    """NVFP4 blocks of 2-D data: the data are e2m1 codes (uint8, one
    per element); the scale is fp32 (2, ceil(R / rows), ceil(C / cols)): ``scale[0]`` one
    e4m3 block scale (its value) per ``rows`` x ``cols`` block, ``scale[1]`` the tensor's
    decode scale in every place; both *multiply* the e2m1 values back
    (``hp ~ e2m1 * scale[0] * scale[1]``). Blocks are 1 x 16 / 16 x 1 for activations and
    gradients (16 along the dim the gemm reduces), 16 x 16 for weights (their own transpose:
    one cast serves both gemms). ``hadamard``: the data are of the Hadamard-transformed
    tensor (``hadamard`` along the 16-long dim; the grad_weight gemm's operands),
    which ``dequantize`` undoes and the gemm does not need to (it cancels in the product)."""

    capabilities = Capabilities(
        scaling_types=(ScalingType.DYNAMIC,),
        fsdp_float8_all_gather=True,
        tensor_parallel=None,
        experts=False,
        ep_dispatch=False,
        # the CUDA kernel's K (16 bytes of packed e2m1) in both of a layer's dims
        layer_multiple=32,
        min_cuda_capability=versions.MX_MIN_CAPABILITY,
        gemm="nvfp4",
    )
    _named = "an NVFP4"

    rows: int
    cols: int
    hadamard: bool = False

    def quantize(self, hp, scale, fp8_dtype, guard):
        # the same cast again, with the scale it used
        return quantize(hp, self.nvfp4_block, hadamard_dim=self.hadamard_dim, scale=scale)

    def quantize_dynamic(self, hp, fp8_dtype, cast, round_to_pow2):
        return quantize(
            hp,
            self.nvfp4_block,
            hadamard_dim=self.hadamard_dim,
            stochastic=cast.granularity_options.stochastic_rounding,
        )

    @property
    def nvfp4_block(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def hadamard_dim(self) -> int | None:
        """The dim the transform runs along (the one the 16-element blocks do), or None."""
        if not self.hadamard:
            return None
        return 0 if self.rows > 1 else 1

    @classmethod
    def for_operand(cls, cast, role, reduce_dim, ndim):
        # weights in 16x16 blocks (one cast for both gemms), activations and gradients in
        # 16 along the reduced dim
        b = NVFP4_BLOCK
        if ndim != 2:
            raise ValueError(f"float8kit: an NVFP4 cast takes 2-D operands, got {ndim}-D")
        rht = cast.granularity_options.hadamard
        if role is GemmRole.WEIGHT:
            return cls(b, b, rht)
        return cls(1, b, rht) if reduce_dim in (1, -1) else cls(b, 1, rht)

    def short(self) -> str:
        return f"nvfp4({self.rows}x{self.cols}{', rht' if self.hadamard else ''})"

    def emulated_mm(self, a, b):
        """``a @ b`` of two NVFP4 training tensors off CUDA, in fp32 (``_nvfp4_emulated_mm``)."""
        blocks = list(a._gran.nvfp4_block), list(b._gran.nvfp4_block)
        return _nvfp4_emulated_mm(a._data, a._scale, blocks[0], b._data, b._scale, blocks[1])

    def amax(self, hp):
        return scaling.block_amax(hp, self.nvfp4_block)

    def expand(self, scale, shape):
        return scaling.expand_block_scale(scale[0] * scale[1], self.nvfp4_block, shape)

    def dequantize(self, data, scale):
        out = values(data, scale, self.nvfp4_block)
        if self.hadamard:
            out = hadamard(out, self.hadamard_dim, inverse=True)
        return out

    def multiplier(self, scale, shape):
        return self.expand(scale, shape).reciprocal()

    def cast_input(self, hp):
        dim = self.hadamard_dim
        return hp if dim is None else hadamard(hp, dim)

    def elements(self, data):
        return decode(data)

    def element_max(self, data):
        return E2M1_MAX

    # ------------------------------------------------------------------ FSDP2 all-gather
    # The weight's one NVFP4 copy (16x16 blocks serve the output and the grad_input gemm
    # alike), gathered as e2m1 codes. Each rank casts its rows with the *whole* weight's
    # scales, so the gathered weight is bitwise the one-device cast (``quantize(w, (16,
    # 16))``):
    #
    # - The scales need every block's amax and the tensor's (the max of the blocks'): each
    #   rank takes the amaxes of the blocks its rows touch (a block cut by a shard boundary
    #   gets a partial amax from each side), and one all-reduce(MAX) of the block-amax grid
    #   (with a NaN flag per block: MAX is not defined on NaN) gives every rank the full grid.
    #   The block amaxes join ``precompute_scales``' one all-reduce after the optimizer step,
    #   and the hooks of the next step use the scale it keeps; without a fresh one (the first
    #   step, no ``precompute_scales``) the hook all-reduces itself and keeps its scale, so
    #   the backward's re-gather reuses the forward's (``job.kept_scale``: fresh while the
    #   weight is the same parameter at the same version with no optimizer step, alike on
    #   every rank; a forward never reuses a hook's).
    # - The shard's codes: its elements times their block's factor ``(1 / tensor_scale) /
    #   block_scale``, rounded to nearest: the products the one-device cast forms.
    #
    # What travels: the codes packed two per byte (0.5 byte per element, a quarter of bf16's)
    # when FSDP2's shards are even (``packs``). On uneven shards FSDP2 requires every
    # all-gather input to have the padded shard's *shape*, which packed rows do not: the codes
    # then travel one per byte. The scale grid (the same on every rank) reaches the post hook
    # as metadata. An odd in_features cannot be packed: refused at the first gather.

    def all_gather_inputs(self, job):
        check_one_dim_mesh(job, "NVFP4")
        n, k = job.outer_size
        packed = packs(n, job.world)
        if packed and k % 2:
            raise ValueError(
                f"float8kit: {job.layer}: an NVFP4 float8 all-gather packs two e2m1 codes per "
                f"byte along in_features, which must be even (here {k}); keep this layer in hp "
                "(the default module filter does)"
            )
        shard = job.shard
        start = min(job.where.offset if job.where.dim == 0 else 0, n)
        scale = job.kept_scale(lambda: _partial_amaxes(shard, start, job.outer_size))
        if scale is None:
            partial = job.all_reduce_max(_partial_amaxes(shard, start, job.outer_size))
            scale = job.keep(_scale_of_grid(partial), partial)
        codes = _cast_rows(shard, start, scale)
        if packed:
            codes = pack(codes)
        # uneven or empty shard: zero rows up to FSDP2's padded shard size
        return (job.pad(codes, math.ceil(n / job.world)),), (scale, n, packed)

    def all_gathered(self, outputs, metadata, config):
        (data,), (scale, rows, packed) = outputs, metadata
        codes = unpack(data[:rows]) if packed else data[:rows]
        # FSDP2 frees these after the pass and re-allocates them before the next gather
        return codes, scale.clone(), FSDP_WEIGHT, ((data, codes) if packed else (data,))

    def refill(self, weight, outputs, metadata):
        (data,), (scale, rows, packed) = outputs, metadata
        refill_scale(weight, scale)
        if packed:  # the codes alike, in place without a version bump (see refill_scale)
            with torch.autograd._unsafe_preserve_version_counter(weight._data):
                weight._data.copy_(unpack(data[:rows]))

    def precomputes(self, where, world):
        return where.n_slots == 1  # (the hook refuses multi-dim meshes)

    def precompute_amaxes(self, shards, wheres):
        parts = []
        for shard, where in zip(shards, wheres, strict=True):
            start = where.offset if where.dim == 0 else 0
            parts.append(_partial_amaxes(shard, start, where.outer_shape))
        return [p.reshape(-1) for p in parts], [p.shape for p in parts]

    def precomputed_scales(self, reduced, shapes, cast, config):
        return [_scale_of_grid(r) for r in split_flat(reduced, shapes)]


# ---------------------------------------------------------------------------- gemm plan


def check_gemm(a: torch.Tensor, b: torch.Tensor) -> None:
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
    (``formats.NVFP4``) as fp32 values, multiplied in fp32; fp32 out. Opaque to
    ``torch.compile`` (as ``mx_emulated_mm``): compiled is bitwise eager for this gemm."""
    return values(a, a_scale, tuple(a_block)) @ values(b, b_scale, tuple(b_block))


@_nvfp4_emulated_mm.register_fake
def _(a, a_scale, a_block, b, b_scale, b_block):
    return a.new_empty((a.size(0), b.size(1)), dtype=torch.float32)


def _per_row_blocks(scale: torch.Tensor, block: tuple[int, int], rows: int) -> torch.Tensor:
    """(rows, K / 16) block scales of an operand blocked 16 along its dim 1 (its K): a 16x16
    block's scale repeated for each of its rows."""
    return scale.repeat_interleave(block[0], dim=0)[:rows]


def nvfp4_kernel_operands(
    a: torch.Tensor, b: torch.Tensor, gemm: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the CUDA NVFP4 gemm hands ``torch._scaled_mm`` for ``a @ b``: A (M, K / 2) and B
    (K / 2, N) column-major as ``torch.float4_e2m1fn_x2`` (codes packed two per byte along
    K, ``nvfp4.pack``), K zero-padded to whole 32s where ``nvfp4_kernel_plan`` says so (code
    0 = +0.0); A's block scales (M, K / 16) and B's (N, K / 16) as e4m3 in cuBLAS's blocked
    layout (``to_blocked``); and the product of both tensor scales (fp32, 0-d), which
    multiplies the result. Runs on any device (the codes are moved, never rounded), so the
    layout is testable on CPU."""
    check_gemm(a, b)
    pad = nvfp4_kernel_plan(a.shape[1], b.shape[1], gemm).pad_inner
    a_codes, b_codes = a._data, b._data.t()  # both (rows, K), K contiguous after packing
    sa = _per_row_blocks(a._scale[0], a._gran.nvfp4_block, a.shape[0])
    b_block = b._gran.nvfp4_block
    sb = _per_row_blocks(b._scale[0].t(), (b_block[1], b_block[0]), b.shape[1])
    if pad:  # zero codes; the padded K blocks' scales are 0 (a 16-block of zeros either way)
        a_codes, b_codes = pad_to(a_codes, 1, 32), pad_to(b_codes, 1, 32)
        blocks = (a.shape[1] + pad) // NVFP4_BLOCK
        sa, sb = (F.pad(s, (0, blocks - s.shape[1])) for s in (sa, sb))
    fp4 = torch.float4_e2m1fn_x2
    a_fp4 = pack(a_codes.contiguous()).view(fp4)
    b_fp4 = pack(b_codes.contiguous()).view(fp4).t()
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
    return k32_plan("NVFP4", k, n, gemm, torch.float32)


# ---------------------------------------------------------------------------- FSDP2 shards

# the gathered weight's format: one 16x16-block copy for both of its gemms
FSDP_WEIGHT = NVFP4(NVFP4_BLOCK, NVFP4_BLOCK)


def packs(rows: int, world: int) -> bool:
    """Whether the codes travel packed: FSDP2's dim-0 shards of ``rows`` rows are even."""
    return rows % world == 0


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Codes two per byte (``pack``) back to one per byte."""
    rows, cols = packed.shape
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(rows, 2 * cols)


def _cast_rows(shard: torch.Tensor, start: int, scale: torch.Tensor) -> torch.Tensor:
    """The codes of weight rows ``start:start + len(shard)`` cast with the whole weight's
    ``scale``: per element the fp32 product the one-device cast forms, rounded to nearest."""
    factor = (1.0 / scale[1]) / scale[0]  # per 16x16 block, as quantize
    rows = (torch.arange(shard.shape[0], device=shard.device) + start) // NVFP4_BLOCK
    per_element = factor[rows].repeat_interleave(NVFP4_BLOCK, dim=1)[:, : shard.shape[1]]
    return round_nearest(torch.clamp(shard.to(torch.float32) * per_element, -E2M1_MAX, E2M1_MAX))


def _scale_of_grid(reduced: torch.Tensor) -> torch.Tensor:
    """The whole weight's scale (2, ceil(N / 16), ceil(K / 16)) from its all-reduced
    ``_partial_amaxes``."""
    grid = torch.where(reduced[1] > 0, math.nan, reduced[0])
    tensor = tensor_scale(scaling.amax(grid))  # NaN propagates, as one device's
    blocks = block_scale(grid, tensor)
    return torch.stack([blocks, tensor.expand_as(blocks)])


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
    padded = F.pad(shard, (0, 0, top, 0))  # to the block boundary above
    part = scaling.block_amax(padded, (b, b))
    grid[start // b : start // b + part.shape[0]] = part
    return grid
