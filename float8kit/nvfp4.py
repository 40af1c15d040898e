"""NVFP4, the format: e2m1 elements, one e4m3 scale per 16, one fp32 scale per tensor.

The math of an NVFP4 cast in torch ops: the CPU reference, and what every device runs up
to the gemm (float8kit.gemm.nvfp4_scaled_mm packs it for the CUDA kernel). The layer-level
decisions (which operand, which block shape, rounding, transform) are
``float8kit.cast.cast_to_float8``'s; the scale layout is ``granularity.NVFP4``'s.

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

import torch

from float8kit import scaling
from float8kit.config import E4M3, NVFP4_BLOCK

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
    scale in every place (``granularity.NVFP4``). ``hadamard_dim``: transform along that dim
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
