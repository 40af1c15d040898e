"""Formats: the layout of a quantized tensor, one module each, and their registry.

A ``Float8TrainingTensor`` carries one format object (``_gran``). Everything that depends on
the format asks it instead of branching on which one it is: how to quantize (with a given
scale, or with the scale it makes itself), the scale's shape per element (``expand``), what
a metadata op (transpose, view, slice, split, cat, FSDP2's leading-rows ``as_strided``) does
to the scale, a weight shard's scale under FSDP2, and what it supports (``capabilities``:
FSDP2 float8 all-gather, tensor parallelism, experts, expert-parallel dispatch, the layer
dims it needs, the GPUs whose kernels run it, its gemm family).

- ``Tensorwise`` (formats/tensorwise.py): one scale, shape ``()``.
- ``Axiswise(dim)`` (axiswise.py): one scale per slice along ``dim`` (rowwise).
- ``Blockwise(rows, cols)`` (blockwise.py): one scale per block of 2-D data.
- ``MX(dim)`` (mx.py): one e8m0 scale per 32 elements along ``dim`` (MXFP8).
- ``NVFP4(rows, cols, hadamard)`` (nvfp4.py): e2m1 codes, e4m3 block scales, an fp32
  tensor scale.

``FORMATS`` maps each ``ScalingGranularity`` to its format class; ``of(cast, role,
reduce_dim, ndim)`` is the object an operand is cast in. A new format is one module here
and its line in ``FORMATS``. Objects are frozen and hashable: compiled graphs guard on
them. Internal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from float8kit.config import CastConfig, GemmRole, ScalingGranularity
from float8kit.formats.axiswise import Axiswise
from float8kit.formats.base import (
    GLOBAL_AMAX,
    LOCAL_BLOCKS,
    Capabilities,
    Format,
    ShardSpec,
    to_fp8_saturated,
)
from float8kit.formats.blockwise import Blockwise, to_fp8_blocks
from float8kit.formats.mx import MX, to_mx
from float8kit.formats.nvfp4 import NVFP4
from float8kit.formats.tensorwise import TENSORWISE, Tensorwise

# the registry: every format, by the CastConfig.scaling_granularity that names it
FORMATS: dict[ScalingGranularity, type[Format]] = {
    ScalingGranularity.TENSORWISE: Tensorwise,
    ScalingGranularity.AXISWISE: Axiswise,
    ScalingGranularity.BLOCKWISE: Blockwise,
    ScalingGranularity.MX: MX,
    ScalingGranularity.NVFP4: NVFP4,
}


def of(cast: CastConfig, role: GemmRole, reduce_dim: int, ndim: int) -> Format:
    """The format of an ``ndim``-D operand of ``role`` cast per ``cast`` for a gemm that
    reduces its dim ``reduce_dim``."""
    return FORMATS[cast.scaling_granularity].for_operand(cast, role, reduce_dim, ndim)


def weight(cast: CastConfig) -> Format:
    """The format of a 2-D (N, K) weight cast per ``cast`` for the output gemm."""
    return of(cast, GemmRole.WEIGHT, -1, 2)


def capabilities(cast: CastConfig) -> Capabilities:
    """What the format ``cast`` names supports."""
    return FORMATS[cast.scaling_granularity].capabilities


def enabled_casts(config) -> Iterator[tuple[str, CastConfig]]:
    """``(field, cast)`` of every enabled CastConfig field of a config dataclass."""
    for f in dataclasses.fields(config):
        cast = getattr(config, f.name)
        if isinstance(cast, CastConfig) and cast.enabled:
            yield f.name, cast


def supporting(ok: Callable[[Capabilities], bool]) -> list[str]:
    """The ``scaling_granularity`` values of the formats whose capabilities ``ok`` accepts."""
    return [g.value for g, fmt in FORMATS.items() if ok(fmt.capabilities)]


def require(config, ok: Callable[[Capabilities], bool], what: str, fix: str) -> None:
    """The allowlist: raise ``ValueError`` naming the first enabled cast field of ``config``
    whose format ``ok`` refuses, what supports it instead, and ``fix``."""
    for field, cast in enabled_casts(config):
        if not ok(capabilities(cast)):
            fine = supporting(ok)
            raise ValueError(
                f"float8kit: {what} does not support {type(config).__name__}.{field} with "
                f"scaling_granularity={cast.scaling_granularity.value!r} (it supports "
                f"{', '.join(fine) or 'no format'}): {fix}"
            )


__all__ = [
    "FORMATS", "GLOBAL_AMAX", "LOCAL_BLOCKS", "MX", "NVFP4", "TENSORWISE", "Axiswise",
    "Blockwise", "Capabilities", "Format", "ShardSpec", "Tensorwise", "capabilities",
    "enabled_casts", "of", "require", "supporting", "to_fp8_blocks", "to_fp8_saturated", "to_mx",
    "weight",
]  # fmt: skip
