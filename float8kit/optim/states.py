"""Block-quantized optimizer states: how AdamW8bit and AdamW4bit keep m and sqrt(v).

A state of a parameter with ``rows = shape[0]`` is kept as the parameter's trailing dims
flattened, (rows, cols), and each row is cut into blocks of ``block`` consecutive elements
(the last one shorter when the row is): one fp32 scale per block, one code per element.
Blocks never cross dim 0, so a parameter sharded along dim 0 (FSDP2 at any world size, even
shards or not) holds on each rank exactly the blocks one device computes for those rows: the
state and the update do not depend on the mesh, bit for bit.

What is kept, and why:

- **m** (signed): the block's amax maps to the codec's largest value; elements round to
  nearest (ties to even). 8 bits: e4m3 (3 mantissa bits, 2**18 of range below the block's
  amax). 4 bits: e2m1, NVFP4's element (values 0, 0.5 ... 6; two per byte).
- **sqrt(v)** (the root of the second moment, >= 0), not v: the update divides by it, so a
  code's relative error is the update's, and the root needs half the range of v. A positive
  root never decodes to 0 (Adam would divide by eps alone and take a huge step): it rounds up
  to the smallest code instead, which can only make that element's step smaller. 8 bits: e4m3.
  4 bits: 16 powers of sqrt(2) below the block's amax (2**0 ... 2**-7.5), to nearest in log
  scale (a tie goes up).

Rounding is to nearest everywhere (deterministic: every rank and every resumed run agrees).
Encoding and decoding are elementwise IEEE operations (a division by a constant goes through
``divide``, correctly rounded on every device), conversions, comparisons and table
lookups only (the one exp2, e2m1's decode, of whole numbers: exact; no other transcendental
function, whose vectorized and scalar implementations may differ in the last bit), so an
element's codes do not depend on where it sits in a shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from float8kit import scaling
from float8kit.config import E4M3
from float8kit.formats import nvfp4

# the 4-bit roots: code k is 2**(-k/2); a value r in [0, 1] gets the nearest in log scale,
# k = the number of midpoints 2**(-(k + 1/2)/2) above r (ties go up: to the larger value),
# which in each binade are exactly 2**e times these two (frexp's mantissa is compared).
# Encoding and decoding build powers of two from their bits: no table reaches a device.
_ROOT4_CUTS = (float(torch.tensor(2.0**-0.25)), float(torch.tensor(2.0**-0.75)))
_ROOT_HALF = float(torch.tensor(2.0**-0.5))


def _e4m3(q: torch.Tensor) -> torch.Tensor:
    return q.to(E4M3).view(torch.uint8)


def _e4m3_root(q: torch.Tensor) -> torch.Tensor:
    codes = _e4m3(q)
    return torch.where((codes == 0) & (q > 0), 1, codes).to(torch.uint8)


def _e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(E4M3).to(torch.float32)  # exact; NaN codes decode to NaN


def _root4_values(codes: torch.Tensor) -> torch.Tensor:
    k = codes.to(torch.int32)  # 2**(-k/2) = (1 or 2**-0.5) * 2**-(k // 2), the latter's bits:
    power = ((127 - (k >> 1)) << 23).view(torch.float32)
    return torch.where((k & 1) == 1, _ROOT_HALF, 1.0) * power


def _root4(q: torch.Tensor) -> torch.Tensor:
    # r = m * 2**e, m in [0.5, 1): code -2e, one more per cut above m; 0 and below: code 15
    m, e = torch.frexp(q)  # (a NaN: code 0, as its block's NaN scale decodes it anyway)
    k = (m < _ROOT4_CUTS[0]).to(torch.int32) + (m < _ROOT4_CUTS[1]) - 2 * e
    return torch.where(q <= 0, 15, k).clamp_(0, 15).to(torch.uint8)


def divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` correctly rounded on every device. CUDA divides by a Python number (a
    CPU scalar) as a multiply by its reciprocal, which can be an ulp off the CPU's division;
    a 0-dim divisor on ``x``'s device is divided by on both."""
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


@dataclasses.dataclass(frozen=True)
class Codec:
    """How one state's elements become codes: ``encode`` takes fp32 values already divided
    by their block's scale (``|q| <= largest``) to uint8 codes; ``decode`` reads them back
    (fp32). ``bits`` 4 keeps two codes per byte."""

    name: str
    bits: int
    largest: float
    decode: Callable[[torch.Tensor], torch.Tensor]
    encode: Callable[[torch.Tensor], torch.Tensor]


E4M3_CODEC = Codec("e4m3", 8, 448.0, _e4m3_values, _e4m3)
E4M3_ROOT = Codec("e4m3 root", 8, 448.0, _e4m3_values, _e4m3_root)
E2M1_CODEC = Codec("e2m1", 4, nvfp4.E2M1_MAX, nvfp4.decode, nvfp4.round_nearest)
ROOT4 = Codec("sqrt(2) powers", 4, 1.0, _root4_values, _root4)


def code_cols(codec: Codec, cols: int) -> int:
    """Bytes per row of codes for a row of ``cols`` elements."""
    return cols if codec.bits == 8 else (cols + 1) // 2


def scale_cols(cols: int, block: int) -> int:
    """Scales per row: the blocks of a row of ``cols`` elements."""
    return -(-cols // block)


def quantize(x: torch.Tensor, codec: Codec, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (rows, ``code_cols``) uint8 and scales (rows, ``scale_cols``) fp32 of the fp32
    (rows, cols) ``x``. A block of zeros has scale 0 (it decodes to zeros, whatever its
    codes); a NaN or inf element makes its block's scale NaN or inf, so the whole block
    decodes non-finite: never saturated away."""
    scale = divide(scaling.block_amax(x, (1, block)), codec.largest)
    divisor = torch.where(scale == 0, 1.0, scale)
    q = x / scaling.expand_block_scale(divisor, (1, block), x.shape)
    codes = codec.encode(q)
    if codec.bits == 4:
        codes = nvfp4.pack(F.pad(codes, (0, codes.shape[1] % 2)))
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, codec: Codec, block: int, cols: int):
    """The fp32 (rows, ``cols``) values of ``quantize``'s codes and scales."""
    if codec.bits == 4:
        codes = nvfp4.unpack(codes)[:, :cols]
    values = codec.decode(codes)
    return values * scaling.expand_block_scale(scale, (1, block), values.shape)


def zeros(rows: int, cols: int, codec: Codec, block: int, device) -> tuple[torch.Tensor, ...]:
    """The codes and scales of a (rows, cols) state of zeros (every scale 0)."""
    codes = torch.zeros((rows, code_cols(codec, cols)), dtype=torch.uint8, device=device)
    return codes, torch.zeros((rows, scale_cols(cols, block)), device=device)
