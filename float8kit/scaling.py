"""Scaling math: every form of amax (whole tensor, per slice, per block, per token group, of
a DTensor, of a shard's scaling groups), amax -> scale, power-of-2 rounding, and the batched
amax-history update of DELAYED scaling. The cast that applies a scale is ``float8kit.cast``.

Convention (everywhere in float8kit): ``fp8 = saturate(hp * scale)`` and ``hp ~ fp8 / scale``
with ``scale = fp8_max / max(amax, amax_floor(fp8_dtype))`` correctly rounded to fp32. Every
function here is plain tensor math with no host sync, so eager and ``torch.compile`` produce
bitwise-equal scales.

Non-finite values stay visible: a NaN amax gives a NaN scale, an inf amax scale 0, so the
cast yields NaN; amaxes that cross ranks turn NaN into inf first (``nan_to_inf``), since an
all-reduce(MAX) may drop a NaN but keeps inf.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from float8kit.config import E4M3, E5M2

# Sentinel of DELAYED/STATIC state (amaxes and scales are never negative): an amax slot with
# no record, or a scale that is not set yet.
UNSET = -1.0

_FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
_EXPONENT_MASK = 0x7F800000  # fp32 sign 0, exponent bits set, mantissa 0


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of a float8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return _FP8_MAX[dtype]


def fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32: itself if it is (no op dispatched, eager's per-call cost), else a copy."""
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` in fp32: what a gemm multiplies an operand's float8 products by."""
    return fp32(scale).reciprocal()


def _quotient(limit: float | torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    # limit / amax (limit = fp8_max) correctly rounded to fp32, for fp32 amax > 0. torch evaluates
    # ``scalar / tensor`` as ``reciprocal(tensor) * scalar``: two roundings, and about 1 fp32
    # scale in 4 lands one ulp off (an element on a rounding tie then casts to the
    # neighbouring float8 value). In fp64 the quotient of two fp32 values is within 2^-52 of
    # exact however it is evaluated, and at least 2^-49 away from every fp32 rounding midpoint
    # (fp8_max = 7 * 2^k cannot make an exact tie), so one rounding to fp32 is the correct one:
    # in eager and under compile (inductor may rewrite a division), on every device.
    # torchao.float8 computes its scale in fp64 too, so tensorwise casts are bitwise its own.
    return amax.to(torch.float64).reciprocal_().mul_(limit).to(torch.float32)


def _smallest_finite_floor(fp8_dtype: torch.dtype) -> float:
    # The smallest fp32 amax whose scale fp8_max / amax is still a finite fp32 (about
    # fp8_max / 3.4e38): a fixed floor like 1e-12 would cast a tensor of ~1e-20 to zeros.
    # An fp32 value, so eager and compiled clamps see the same constant bit for bit.
    limit = fp8_max(fp8_dtype)
    floor = torch.tensor(limit / torch.finfo(torch.float32).max, dtype=torch.float32)
    while not torch.isfinite(_quotient(limit, floor)):
        floor = torch.nextafter(floor, torch.tensor(math.inf))
    return floor.item()


# amax floor per float8 dtype: an all-zero tensor gets the largest finite scale (and casts
# to zeros); every amax above it, however tiny, keeps its exact scale.
_AMAX_FLOOR = {dtype: _smallest_finite_floor(dtype) for dtype in _FP8_MAX}


def amax_floor(fp8_dtype: torch.dtype) -> float:
    """The amax floor of ``amax_to_scale``: the smallest amax whose scale is finite in fp32."""
    return _AMAX_FLOOR[fp8_dtype]


def amax(hp: torch.Tensor, reduce_dim: int | None = None) -> torch.Tensor:
    """max(|hp|) in fp32: over the whole tensor (``reduce_dim=None``, shape ``()``), or along
    ``reduce_dim`` keeping it (one amax per row/column). NaN propagates. An empty tensor
    (or slice) has amax 0, like a zero one (``torch.amax`` refuses to reduce nothing)."""
    if hp.numel() == 0:
        shape = () if reduce_dim is None else list(hp.shape)
        if reduce_dim is not None:
            shape[reduce_dim] = 1
        return torch.zeros(shape, dtype=torch.float32, device=hp.device)
    # one op: max|x| of the values upcast to fp32 (exact); fp64 rounds its amax after
    dtype = None if hp.dtype == torch.float64 else torch.float32
    norm = torch.linalg.vector_norm(hp, math.inf, reduce_dim, reduce_dim is not None, dtype=dtype)
    return fp32(norm)


def _smallest_safe_power_of_2(fp8_dtype: torch.dtype) -> float:
    # The smallest power of two p with fp8_max / p finite in fp32: a scale below it leaves
    # float8 values v (v <= fp8_max) whose dequantized v / scale is past fp32's max, which a
    # finite value near that max reaches by rounding up (3.4e38 * 2^-120 = 255.9 -> 256 in
    # e4m3, and 256 * 2^120 = inf). 2^-119 for e4m3, 2^-112 for e5m2.
    limit, top = fp8_max(fp8_dtype), torch.finfo(torch.float32).max
    p = 1.0
    while limit / p <= top:
        p /= 2
    return p * 2


_SAFE_POW2 = {dtype: _smallest_safe_power_of_2(dtype) for dtype in _FP8_MAX}


def round_to_power_of_2(scale: torch.Tensor) -> torch.Tensor:
    """Floor positive fp32 scales to a power of two by clearing the mantissa bits (exact,
    no log2 rounding). 0 and inf are kept; NaN stays NaN."""
    assert scale.dtype == torch.float32, "scales are fp32"
    floored = (scale.view(torch.int32) & _EXPONENT_MASK).view(torch.float32)
    return torch.where(torch.isnan(scale), scale, floored)


def row_constants(fp8_dtypes, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a batch of amaxes whose rows cast to ``fp8_dtypes`` (one each): the constants
    ``amax_to_scale`` takes from one dtype, per row (fp8_max in fp64, the amax floor and the
    smallest safe power-of-2 scale in fp32: the values its scalars are), so rows of several
    dtypes take one batch of ops with the bits of their own dtypes'."""
    tables = ((_FP8_MAX, torch.float64), (_AMAX_FLOOR, torch.float32), (_SAFE_POW2, torch.float32))
    rows = [torch.tensor([t[d] for d in fp8_dtypes], dtype=dt, device=device) for t, dt in tables]
    return tuple(rows)


def amax_to_scale(
    amax: torch.Tensor, fp8_dtype: torch.dtype | tuple, round_to_pow2: bool = False
) -> torch.Tensor:
    """``fp8_max / max(amax, amax_floor(fp8_dtype))``, correctly rounded to fp32: always
    finite for a finite amax (an all-zero tensor gets the largest finite scale and casts to
    zeros). An inf amax gives scale 0 and a NaN amax a NaN scale, so a cast with it yields
    NaN: overflow stays visible downstream.

    ``round_to_pow2`` floors the scale to a power of two, except for an amax above
    ``fp8_max * 2^-k`` (k = 119 for e4m3, 112 for e5m2: about 2.98e38), where the floored
    scale would let a value round up past fp32's max on the way back (``fp8 / scale`` =
    inf): there the scale stays the exact quotient, whose casts saturate at fp8_max and come
    back finite. Scale rounding never turns a finite value into inf.

    ``fp8_dtype`` may be the amaxes' ``row_constants`` instead (rows of several dtypes)."""
    if isinstance(fp8_dtype, tuple):
        limit, floor, safe = fp8_dtype
    else:
        limit, floor, safe = fp8_max(fp8_dtype), amax_floor(fp8_dtype), _SAFE_POW2[fp8_dtype]
    # clamp_min keeps NaN (torch.clamp propagates it), unlike torch.maximum with a scalar.
    scale = _quotient(limit, torch.clamp(fp32(amax), min=floor))
    if round_to_pow2:
        floored = round_to_power_of_2(scale)
        # NaN, and 0 from an inf amax, fail the comparison and keep the quotient's NaN / 0
        scale = torch.where(floored >= safe, floored, scale)
    return scale


def blocked(hp: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``hp`` (R, C) zero-padded to whole blocks and shaped (R/br, br, C/bc, bc): a partial
    block at the end (e.g. a token count that is not a multiple of 128) is padded with
    zeros, which change neither its amax nor the sums of a gemm."""
    (r, c), (br, bc) = hp.shape, block
    pad_r, pad_c = -r % br, -c % bc
    if pad_r or pad_c:
        hp = F.pad(hp, (0, pad_c, 0, pad_r))
    return hp.reshape((r + pad_r) // br, br, (c + pad_c) // bc, bc)


def block_amax(hp: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max(|hp|) in fp32 per ``block`` = (rows, cols) block of a 2-D ``hp``: shape
    (ceil(R / rows), ceil(C / cols)). NaN propagates; an empty block has amax 0."""
    (r, c), (br, bc) = hp.shape, block
    if hp.numel() == 0:
        return torch.zeros((-(-r // br), -(-c // bc)), dtype=torch.float32, device=hp.device)
    return torch.amax(torch.abs(blocked(hp, block)), dim=(1, 3)).to(torch.float32)


def expand_block_scale(scale: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    """Per-block ``scale`` repeated to one scale per element of a tensor of ``shape``."""
    full = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[: shape[0], : shape[1]]


def update_amax_history(history: torch.Tensor, new_amax: torch.Tensor) -> torch.Tensor:
    """Push one step's amax into a batch of amax histories.

    Args:
        history: (R, L) fp32, one history per row, newest first; ``UNSET`` marks empty slots.
        new_amax: (R,) fp32, the amax each row recorded this step (``UNSET`` = no record).

    Returns:
        The new (R, L) histories. A row with a finite record gets it in front and drops its
        oldest entry. A row with no record, or a non-finite one (inf/NaN: an overflow that
        the step already showed as non-finite output), keeps its history unchanged, so one
        overflow does not poison the scale for the next L steps.
    """
    pushed = torch.cat([new_amax[:, None], history[:, :-1]], dim=1)
    # NaN >= 0 is False, so NaN rows are kept too.
    take = (new_amax >= 0) & torch.isfinite(new_amax)
    return torch.where(take[:, None], pushed, history)


def history_to_scale(
    history: torch.Tensor,
    fp8_dtype: torch.dtype | tuple,
    from_max: bool,
    round_to_pow2: bool = False,
) -> torch.Tensor:
    """Scales (R,) from (R, L) amax histories: from each row's largest amax (``from_max``)
    or its newest one. A row with no record at all gets ``UNSET``. ``fp8_dtype``: the rows'
    float8 dtype, or their ``row_constants``."""
    amax = history.amax(dim=1) if from_max else history[:, 0]
    scale = amax_to_scale(amax, fp8_dtype, round_to_pow2)
    return torch.where(amax >= 0, scale, torch.full_like(scale, UNSET))


def nan_to_inf(amax: torch.Tensor) -> torch.Tensor:
    """NaN amaxes as +inf: an all-reduce(MAX) may drop a NaN (it compares) but keeps inf, and
    an inf amax gives scale 0, which turns the cast into NaN: a bad shard stays visible on
    every rank instead of saturating."""
    return torch.where(torch.isnan(amax), math.inf, amax)


def recorded_amax(hp: torch.Tensor) -> torch.Tensor:
    """max(|hp|) in ``hp``'s dtype, one reduction op: what a DELAYED cast records when its
    scale is set. max(|x|) is exact in any float dtype, and the fp32 record's ``clamp_``
    promotes it: the same value as ``amax``, two ops fewer per cast."""
    return torch.linalg.vector_norm(hp, ord=math.inf)


def amax_of_partial_bits(bits: torch.Tensor) -> torch.Tensor:
    """The amax of a tensor from its blocks' max|x|, given as the int32 bits of non-negative
    fp32 values (the partial maxima a cast kernel writes, float8kit/triton_cast.py): a
    scalar fp32, NaN if any block had a NaN (its bits are the largest)."""
    return bits.view(torch.float32).amax()


def local_amaxes(hps: list[torch.Tensor]) -> torch.Tensor:
    """max(|t|) of each tensor in one batched pass: 1-D fp32, one entry per tensor. An empty
    tensor (an empty shard) has amax 0; NaN becomes inf (``nan_to_inf``)."""
    nonempty = [t for t in hps if t.numel() > 0]
    norms = iter(
        torch._foreach_norm(nonempty, ord=math.inf, dtype=torch.float32) if nonempty else ()
    )
    amaxes = torch.stack(
        [next(norms) if t.numel() > 0 else t.new_zeros((), dtype=torch.float32) for t in hps]
    )
    return nan_to_inf(amaxes)


def dtensor_amax(hp: DTensor, reduce_dim: int | None) -> torch.Tensor:
    """max(|hp|) of a DTensor as a plain local tensor: the whole tensor's (shape ()) when
    ``reduce_dim`` is None, else one per slice along ``reduce_dim`` for this rank's rows
    (reduced over the ranks that hold parts of the same slice)."""
    if hp.numel() == 0:  # so is every local tensor
        return amax(hp.to_local(), reduce_dim)
    result = amax(hp, reduce_dim)
    # A reduction over a sharded dim is Partial(max): all-reduce it; Shard of other dims
    # stays (the scale of this rank's rows only).
    placements = [Replicate() if p.is_partial() else p for p in result.placements]
    return result.redistribute(placements=placements).to_local()


def group_amax(hp: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """max(|hp|) over each token group, per column: (num_groups, D) fp32 for ``hp`` (T, D),
    ``groups`` the group of each row (``num_groups`` for rows past the last group). An empty
    group has amax 0 (scale: the largest finite one; its gemm sums nothing). NaN propagates."""
    index = groups.unsqueeze(1).expand(hp.shape)
    out = hp.new_zeros((num_groups + 1, hp.size(1)), dtype=torch.float32)
    out = out.scatter_reduce(0, index, hp.abs().to(torch.float32), "amax", include_self=True)
    return out[:num_groups]


def last_dim_amax(hp: torch.Tensor) -> torch.Tensor:
    """max(|hp|) along the last dim, not kept, in ``hp``'s dtype; NaN propagates (the blocks
    of a flattened gradient, float8kit.distributed.reduce_scatter)."""
    return torch.amax(torch.abs(hp), dim=-1)


def row_block_amax(shard: torch.Tensor, block_size: int, start: int) -> torch.Tensor:
    """Partial amaxes of the ``block_size`` x ``block_size`` blocks that the rows of ``shard``
    (rows ``start:start + len(shard)`` of a weight) touch: (block rows touched, column blocks)
    fp32, NaN as inf. One pass over the shard: per row and column block, then the max over
    the rows of each block row (no padding of a few-row shard to whole blocks)."""
    b = block_size
    first = start // b
    n, c = shard.shape
    cols = F.pad(shard, (0, -c % b)) if c % b else shard
    rows = torch.abs(cols).reshape(n, -1, b).amax(-1).to(torch.float32)
    block = torch.arange(start, start + n, device=shard.device) // b - first
    out = rows.new_zeros(((start + n - 1) // b - first + 1, rows.shape[1]))
    out.scatter_reduce_(0, block[:, None].expand_as(rows), rows, "amax")
    return nan_to_inf(out)


# ---------------------------------------------------------------------------- MX blocks
#
# OCP MX (``ScalingGranularity.MX``): one power-of-two scale per 32 consecutive elements
# along one dim, stored as an e8m0 byte (the biased exponent: 2 ** (byte - 127); 255 is
# NaN). Here the scale *decision* (amax -> byte) and the byte's two readings: the
# multiplier a cast applies, and the factor that dequantizes.

_MX_BYTE_NAN = 255
# the exponent of fp8_max: 448 = 1.75 * 2**8, 57344 = 1.75 * 2**15
_FP8_MAX_EXPONENT = {E4M3: 8, E5M2: 15}


def mx_blocks(hp: torch.Tensor, dim: int) -> torch.Tensor:
    """``hp`` with ``dim`` moved last, zero-padded to a multiple of 32 and split in blocks:
    shape (..., ceil(n / 32), 32). A partial last block (a token count that is not a
    multiple of 32) is padded with zeros, which change neither its amax nor a gemm's sums."""
    x = hp.movedim(dim, -1)
    n = x.shape[-1]
    pad = -n % 32
    if pad:
        x = F.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], (n + pad) // 32, 32)


def mx_block_amax(hp: torch.Tensor, dim: int) -> torch.Tensor:
    """max(|hp|) in fp32 per 32 elements along ``dim`` (computed in ``hp``'s dtype, exact):
    ``hp``'s shape with ``dim`` reduced to ceil(n / 32). NaN propagates."""
    if hp.numel() == 0:
        shape = list(hp.shape)
        shape[dim] = -(-shape[dim] // 32)
        return torch.zeros(shape, dtype=torch.float32, device=hp.device)
    amax = torch.amax(torch.abs(mx_blocks(hp, dim)), dim=-1).to(torch.float32)
    return amax.movedim(-1, dim)


def mx_scale_bits(amax: torch.Tensor, fp8_dtype: torch.dtype, rounding: str) -> torch.Tensor:
    """The e8m0 byte (uint8) of each block's scale from its fp32 ``amax``.

    ``"rceil"``: ``ceil(log2(amax / fp8_max))``, the quotient correctly rounded to fp32 and
    its log2 taken exactly from its bits (what cuBLAS's and Transformer Engine's
    ``cvt.rp.satfinite.ue8m0x2.f32`` does: round up, saturate at 2^127); NaN -> 255, inf ->
    254, a zero or tiny block -> 0. No element saturates. ``"floor"``: amax's exponent minus
    fp8_max's (the OCP spec's rounding), clamped to [0, 255]; NaN -> 255. Values above
    ``fp8_max * 2 ** e`` saturate."""
    amax = amax.to(torch.float32)
    if rounding == "floor":
        exp_bits = (amax.view(torch.int32) >> 23) & 0xFF
        byte = torch.clamp(exp_bits - _FP8_MAX_EXPONENT[fp8_dtype], 0, 255)
    else:
        descale = amax / fp8_max(fp8_dtype)
        bits = descale.view(torch.int32)
        exp_bits, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        # normal: 2^(exp - 127) * 1.m, whose ceil(log2) adds 1 unless m == 0; subnormal
        # (exp 0): m * 2^-149 < 2^-126, whose ceil(log2) is -126 above 2^-127, else <= -127
        normal = exp_bits - 127 + (mantissa != 0).to(torch.int32)
        subnormal = -127 + (mantissa > 1 << 22).to(torch.int32)
        ceil_log2 = torch.where(exp_bits > 0, normal, subnormal)
        byte = torch.clamp(ceil_log2, -127, 127) + 127
    byte = torch.where(torch.isnan(amax), _MX_BYTE_NAN, byte)
    return byte.to(torch.uint8)


def _pow2_from_biased(biased: torch.Tensor) -> torch.Tensor:
    """2 ** (biased - 127) in fp32 for int32 ``biased`` in [1, 254] (built from the bits)."""
    return (biased << 23).view(torch.float32)


def mx_multiplier(byte: torch.Tensor, rounding: str) -> torch.Tensor:
    """The fp32 factor a cast multiplies a block by: ``2 ** (127 - byte)``.

    ``"rceil"`` (Transformer Engine's and torchao's reading): byte 255 (NaN) -> NaN, 254 ->
    2^-127, 0 -> 1 (a block that small casts to zeros either way). ``"floor"`` (torchao's
    division by the scale, clamped at fp32's smallest normal 2^-126): byte 255 -> 0 (the
    block's NaN stays NaN, inf becomes NaN), 0 -> 2^126."""
    b = byte.to(torch.int32)
    mult = _pow2_from_biased(254 - torch.clamp(b, 1, 253))
    if rounding == "floor":
        return torch.where(b == _MX_BYTE_NAN, 0.0, mult)
    mult = torch.where(b == 254, 2.0**-127, mult)
    mult = torch.where(b == 0, 1.0, mult)
    return torch.where(b == _MX_BYTE_NAN, math.nan, mult)


def mx_descale(byte: torch.Tensor) -> torch.Tensor:
    """The fp32 factor that dequantizes a block: ``2 ** (byte - 127)``; 255 -> NaN."""
    b = byte.to(torch.int32)
    d = _pow2_from_biased(torch.clamp(b, 1, 254))
    d = torch.where(b == 0, 2.0**-127, d)
    return torch.where(b == _MX_BYTE_NAN, math.nan, d)
