"""OCP MX (MXFP8): one e8m0 power-of-two scale per 32 consecutive elements along ``dim`` (each
gemm's inner dim); the scale has the data's shape with ``dim`` reduced to ceil(n / 32). A
partial last block (a token count) is a block of fewer elements. The scale byte is uint8
holding ``torch.float8_e8m0fnu``'s bits (``2 ** (byte - 127)``), which *divides*:
``hp ~ fp8 * 2 ** (byte - 127)``. The gemm is ``float8kit.gemm.mx_scaled_mm``."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch._subclasses.fake_tensor import is_fake

from float8kit import scaling, versions
from float8kit.config import E4M3, MX_BLOCK, GemmRole, ScalingType
from float8kit.formats.base import (
    AlongDim,
    Capabilities,
    Float8Elements,
    Format,
    check_one_dim_mesh,
    to_fp8_saturated,
)
from float8kit.formats.layout import (
    KernelPlan,
    k32_plan,
    kernel_layouts,
    pad_to,
    to_blocked,
)


@dataclasses.dataclass(frozen=True)
class MX(AlongDim, Float8Elements, Format):
    capabilities = Capabilities(
        scaling_types=(ScalingType.DYNAMIC,),
        fsdp_float8_all_gather=True,
        tensor_parallel=None,
        experts=True,
        ep_dispatch=True,
        layer_multiple=MX_BLOCK,
        min_cuda_capability=versions.MX_MIN_CAPABILITY,
        gemm="mx",
    )
    copy_per_pass = True  # the blocks of one pass's copy run along that gemm's inner dim

    dim: int

    @property
    def mx_dim(self) -> int:
        return self.dim

    def short(self) -> str:
        return f"mx(dim={self.dim}, 1x32)"

    def quantize(self, hp, scale, fp8_dtype, guard):
        # e8m0 bytes: their multiplier 2 ** (127 - byte); always guarded
        return to_fp8_saturated(hp, self.multiplier(scale, hp.shape), fp8_dtype), scale

    def quantize_dynamic(self, hp, fp8_dtype, cast, round_to_pow2):
        return to_mx(hp, self.dim, fp8_dtype, cast.granularity_options.scale_rounding)

    def emulated_mm(self, a, b):
        """``a @ b`` of two MX training tensors off CUDA, in fp32 (``_mx_emulated_mm``)."""
        return _mx_emulated_mm(a._data, a._scale, b._data, b._scale)

    def amax(self, hp):
        return scaling.mx_block_amax(hp, self.dim)

    def expand(self, scale, shape):
        full = scale.repeat_interleave(32, dim=self.dim)
        return full.narrow(self.dim, 0, shape[self.dim])

    def dequantize(self, data, scale):
        descale = scaling.mx_descale(scale)
        return data.to(torch.float32) * self.expand(descale, data.shape)

    def multiplier(self, scale, shape):
        return self.expand(scaling.mx_descale(scale).reciprocal(), shape)

    # e8m0 scales are bytes already: they travel as they are
    def scale_bytes(self, scale, wire):
        return scale

    def scale_from_bytes(self, data, wire):
        return data

    def view(self, scale, old, new, func):
        # flattening / unflattening the leading dims of data blocked along its last dim
        if self.dim == len(old) - 1 and new[-1] == old[-1]:
            return MX(len(new) - 1), scale.reshape(*new[:-1], scale.shape[-1])
        if tuple(new) == tuple(old):
            return self, scale
        raise NotImplementedError(
            f"float8kit: {func} from {tuple(old)} to {tuple(new)} would cut through the 32-"
            f"element MX blocks of a Float8TrainingTensor (blocked along dim {self.dim}); call "
            ".dequantize() first if hp math is really meant"
        )

    def strided(self, scale, rows, ndim):
        # the first whole rows of data blocked along its last dim keep their rows' scales;
        # of 2-D data blocked along its rows (the FSDP2 weight gathered along N, already
        # ``rows`` rows: the identity) the blocks those rows lie in
        if rows is None:
            return None
        if self.dim == ndim - 1:
            return scale[:rows]
        return scale[: -(-rows // 32)] if self.dim == 0 and ndim == 2 else None

    def sliced(self, scale, dim, fn, func):
        if dim == self.dim:
            self._refuse(func)
        return fn(scale)

    def split(self, scale, dim, n, fn, func):
        if dim == self.dim:
            self._refuse(func)
        return fn(scale)

    def cat(self, scales, dim, fn, func):
        if dim == self.dim:
            self._refuse(func)
        return fn(scales)

    def _refuse(self, func):
        raise NotImplementedError(
            f"float8kit: {func} along the blocked dim {self.dim} of an MX Float8TrainingTensor "
            "would cut through its 32-element scale blocks; call .dequantize() first if hp "
            "math is really meant"
        )

    # ------------------------------------------------------------------ FSDP2 all-gather
    # An MX block is not its own transpose: the output gemm needs the (N, K) weight in
    # blocks along K (MX(1)), the grad_input gemm along N (MX(0)). A pass gathers its copy,
    # never both:
    #
    # - forward (any all-gather outside backward): each rank casts its rows along K. A block
    #   lies within one row and FSDP2 shards whole rows (dim 0): each shard casts alone.
    # - backward (FSDP2's re-gather after ``reshard_after_forward``): each rank casts its
    #   rows along N. A block is 32 rows; where a shard boundary falls inside one
    #   (``cut_blocks``), the block's scale byte is the MAX of both sides' partial bytes: one
    #   all-reduce of those blocks' bytes only (K bytes each). The shard is then cast by
    #   ``to_mx`` itself with a value of that byte planted in a padding row
    #   (``_value_of_byte``: one the hp dtype holds), so every byte is the one-device cast's.
    #
    # The fp8 bytes ride FSDP2's all-gather (1 byte per element); the e8m0 scale bytes (1 per
    # 32 elements) take one all-gather of their own, in the hook, and reach the post hook as
    # metadata (FSDP2 requires every all-gather input of an unevenly sharded parameter to
    # have the padded shard's size, which a scale is not). The gathered weight is one object
    # for the whole run (FSDP2's ``out``): a re-gather gives it the pass's copy, so the
    # tensor forward saved holds the along-N copy when backward reads it. A pass without an
    # all-gather of its own gathers its copy through the lifecycle (``fsdp.regather``).
    # Every scale is made in the hook: nothing to precompute.

    def all_gather_inputs(self, job):
        check_one_dim_mesh(job, "MX")
        dim = 0 if job.backward else 1
        shard, world = job.shard, job.world
        cast = _cast_for(job.config, dim)
        fp8_dtype = cast.dtype_for(GemmRole.WEIGHT)
        n = job.outer_size[0]
        chunk = math.ceil(n / world)
        start = min(job.where.offset if job.where.dim == 0 else 0, n)
        if dim == 1:
            data, scale = to_mx(shard, 1, fp8_dtype, cast.granularity_options.scale_rounding)
            scale = job.all_gather_rows(job.pad(scale, chunk))[:n]
        else:
            data, local_scale = _cast_along_rows(job, start, n, fp8_dtype, cast)
            scale = _gather_block_scales(job, local_scale, start, n)
        data = job.pad(data.contiguous().view(torch.uint8), chunk)
        return (data,), (scale, dim, n)

    def all_gathered(self, outputs, metadata, config):
        (data,), (scale, dim, rows) = outputs, metadata
        fp8 = data[:rows].view(_cast_for(config, dim).dtype_for(GemmRole.WEIGHT))
        return fp8, scale, MX(dim), (data,)

    def refill(self, weight, outputs, metadata):
        scale, dim, _ = metadata
        weight._gran, weight._scale = MX(dim), scale

    def precomputes(self, where, world):
        return False


def to_mx(
    hp: torch.Tensor, dim: int, fp8_dtype: torch.dtype = E4M3, rounding: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MX cast (OCP MXFP8): ``(fp8 data, e8m0 scale)`` with one power-of-two scale per
    32 elements of ``hp`` along ``dim`` (a partial last block is a block of fewer elements).

    The scale byte comes from each block's amax (``scaling.mx_scale_bits``; ``rounding``
    "rceil" or "floor"); the data is ``saturate(hp * 2 ** (127 - byte))`` in fp32, rounded
    to ``fp8_dtype``. Returns data of ``hp``'s shape whose memory is ``dim``-major (for
    ``dim`` 0 of a 2-D tensor: column-major, the layout the gemm that reduces that dim
    takes), and the e8m0 scale bytes (uint8: the bits of ``torch.float8_e8m0fnu``, which
    inductor's CPU backend cannot hold) of ``hp``'s shape with ``dim`` reduced to
    ceil(n / 32), laid out the same way.

    Non-finite values stay visible: a block with a NaN gets scale byte 255 and, with
    "rceil", all-NaN data (with "floor", the NaN itself); an inf becomes NaN (e4m3fn has no
    inf; e5m2 keeps inf) where torchao's ``to_mx`` saturates it to fp8_max.
    """
    dim = dim % hp.dim()
    if (
        hp.device.type == "cpu"
        and not versions.CPU_INDUCTOR_FUSES_MX_CASTS
        # dynamo tracing, or AOTAutograd tracing a subclass's ops (the MX experts' weight
        # wrapper), where dynamo's flag is off but the tensors are fake
        and (versions.compiling() or is_fake(hp))
    ):
        data, byte = _to_mx_last_dim(hp.movedim(dim, -1), fp8_dtype, rounding)
        return data.movedim(-1, dim), byte.movedim(-1, dim)
    return _to_mx(hp, dim, fp8_dtype, rounding)


@torch.library.custom_op("float8kit::to_mx_last_dim", mutates_args=())
def _to_mx_last_dim(
    hp: torch.Tensor, fp8_dtype: torch.dtype, rounding: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``to_mx`` along the last dim, an opaque op to a compiled graph where the CPU inductor
    cannot fuse MX casts (``versions.CPU_INDUCTOR_FUSES_MX_CASTS``); contiguous outputs."""
    data, byte = _to_mx(hp, hp.dim() - 1, fp8_dtype, rounding)
    return data.contiguous(), byte.contiguous()


@_to_mx_last_dim.register_fake
def _(hp, fp8_dtype, rounding):
    blocks = (*hp.shape[:-1], -(-hp.shape[-1] // 32))
    return hp.new_empty(hp.shape, dtype=fp8_dtype), hp.new_empty(blocks, dtype=torch.uint8)


def _to_mx(hp: torch.Tensor, dim: int, fp8_dtype: torch.dtype, rounding: str):
    n = hp.shape[dim]
    amax = scaling.mx_block_amax(hp, dim)
    byte = scaling.mx_scale_bits(amax, fp8_dtype, rounding)
    blocks = scaling.mx_blocks(hp, dim)  # (..., nb, 32), dim moved last
    mult = scaling.mx_multiplier(byte, rounding).movedim(dim, -1).unsqueeze(-1)
    scaled = blocks.to(torch.float32) * mult
    limit = scaling.fp8_max(fp8_dtype)
    clamped = torch.clamp(scaled, min=-limit, max=limit)  # keeps NaN
    # an inf in a finite block's scale stays inf after the multiply: NaN (e4m3fn) or inf
    # (e5m2) instead of fp8_max, so that an overflow is never saturated away
    fill = math.nan if fp8_dtype == E4M3 else scaled
    # contiguous in the blocked order: dim-major, as the gemm that reduces ``dim`` takes it
    data = torch.where(torch.isinf(scaled), fill, clamped).to(
        fp8_dtype, memory_format=torch.contiguous_format
    )
    data = data.flatten(-2)  # (not reshape(..., -1): ambiguous for an empty tensor)
    if data.shape[-1] != n:
        data = data[..., :n]
    return data.movedim(-1, dim), byte


# ---------------------------------------------------------------------------- gemm plan


def check_gemm(a: torch.Tensor, b: torch.Tensor) -> None:
    """Both operands MX, blocked along the inner dim K (the left's dim 1, the right's dim 0)."""
    if a._gran.mx_dim != 1 or b._gran.mx_dim != 0:
        raise ValueError(
            f"scaled_mm: an MX gemm needs both operands in MX blocks along the inner dim K; got "
            f"{a._role.value} {a._gran.short()} @ {b._role.value} {b._gran.short()} "
            "(CastConfig.scaling_granularity of both operands of a gemm must be MX, and each "
            "is cast along the dim its gemm reduces)"
        )


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
    a: torch.Tensor, b: torch.Tensor, gemm: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the CUDA MX gemm hands ``torch._scaled_mm`` for MX ``a @ b``: A row-major and B
    column-major, K zero-padded to whole 32-blocks where ``mx_kernel_plan`` says so (zero
    bytes: +0.0, exact), and both scales in cuBLAS's blocked layout (``to_blocked``) as
    ``torch.float8_e8m0fnu``: A's (M, K / 32), B's transposed to (N, K / 32). Runs on any
    device (the bytes are moved, never converted), so the layout is testable on CPU."""
    check_gemm(a, b)
    plan = mx_kernel_plan(a.shape[1], b.shape[1], gemm)
    a_data, b_data = kernel_layouts(a._data, b._data)
    if plan.pad_inner:  # a partial last 32-block of K (a token count)
        a_data = pad_to(a_data, 1, 32)
        b_data = pad_to(b_data.t(), 1, 32).t()
    e8m0 = torch.float8_e8m0fnu  # the bytes, as the kernel's dtype
    scale_a = to_blocked(a._scale).view(e8m0)  # (M, K / 32)
    scale_b = to_blocked(b._scale.t()).view(e8m0)  # (N, K / 32)
    return a_data, b_data, scale_a, scale_b


def mx_kernel_plan(k: int, n: int, gemm: str | None = None) -> KernelPlan:
    """How the CUDA MX gemm runs an (M, K) @ (K, N) gemm: K zero-padded to whole 32-blocks
    (a token count in the grad_weight gemm), bf16 out; raises when N is not a multiple of
    16 (cuBLAS's rule) or K is not a multiple of 32 outside the grad_weight gemm (a layer
    dim: the default module filter keeps such layers in hp)."""
    return k32_plan("MX float8", k, n, gemm, torch.bfloat16)


# ---------------------------------------------------------------------------- FSDP2 shards


def cut_blocks(rows: int, world: int) -> list[int]:
    """The 32-row blocks of a ``rows``-row weight that FSDP2's dim-0 shards over ``world``
    ranks cut (a shard boundary inside the block), in order; alike on every rank."""
    chunk = math.ceil(rows / world)
    cuts = (j * chunk for j in range(1, world))
    return sorted({c // MX_BLOCK for c in cuts if c < rows and c % MX_BLOCK})


def _cast_for(config, dim: int):
    """The cast of the copy blocked along ``dim``: the output gemm's (1) or grad_input's (0)."""
    return config.cast_config_weight_for_grad_input if dim == 0 else config.cast_config_weight


def _cast_along_rows(job, start: int, n: int, fp8_dtype: torch.dtype, cast):
    """The shard's rows cast in 32-row blocks of the full (n-row) weight: ``(data, scale)``
    with ``scale`` the bytes of the blocks the shard touches (block ``start // 32`` on).

    The shard is cast by ``to_mx`` itself, padded to whole blocks of the full weight with
    zero rows (which change no amax). A block cut by a shard boundary gets its whole-block
    scale byte: the byte is monotone in the amax, so it is the MAX over ranks of each part's
    byte (one all-reduce of the cut blocks' bytes, a NaN's 255 included), and a padding row
    of the block (one exists: part of the block lies outside the shard) carries a value of
    that byte (``_value_of_byte``) into ``to_mx``."""
    shard, rounding = job.shard, cast.granularity_options.scale_rounding
    rows = shard.shape[0]
    top = start % MX_BLOCK
    bottom = -(start + rows) % MX_BLOCK
    padded = shard.new_zeros((top + rows + bottom, shard.shape[1]))
    padded[top : top + rows] = shard
    cut = cut_blocks(n, job.world)
    if cut:
        first = start // MX_BLOCK
        local = scaling.mx_block_amax(padded, 0)
        touched = [(i, b - first) for i, b in enumerate(cut) if 0 <= b - first < local.shape[0]]
        parts = shard.new_zeros((len(cut), shard.shape[1]), dtype=torch.uint8)
        for i, j in touched:
            parts[i] = scaling.mx_scale_bits(local[j], fp8_dtype, rounding)
        job.all_reduce_max(parts)
        fp8_max = scaling.fp8_max(fp8_dtype)
        for i, j in touched:
            row = j * MX_BLOCK if j * MX_BLOCK < top else (j + 1) * MX_BLOCK - 1
            padded[row] = _value_of_byte(parts[i], fp8_max, shard.dtype, rounding)
    data, scale = to_mx(padded, 0, fp8_dtype, rounding)
    return data[top : top + rows], scale


def _value_of_byte(byte: torch.Tensor, fp8_max: float, dtype: torch.dtype, rounding: str):
    """An amax in ``dtype`` whose e8m0 byte (``scaling.mx_scale_bits`` with ``rounding``) is
    ``byte``: ``fp8_max * 2 ** (byte - 127)`` (255: NaN) rounded toward zero to ``dtype``.
    The byte's amaxes are a range whose top is that value, and the range holds a value of
    ``dtype`` (the byte came from one): rounded toward zero the value stays in it, where
    rounding to nearest could leave it (fp16's subnormals, near 1e-7: the next byte up). With
    "rceil" the largest finite amaxes round up to a byte whose value is beyond ``dtype``:
    its max has that byte; 254 is an inf amax's."""
    value = scaling.mx_descale(byte) * fp8_max  # fp32; NaN for 255
    if rounding == "rceil":  # (with "floor" a value past fp32's range is an inf amax's)
        value = torch.clamp(value, max=torch.finfo(dtype).max)  # keeps NaN
    held = value.to(dtype)
    held = torch.where(held.float() > value, torch.nextafter(held, torch.zeros_like(held)), held)
    return held if rounding == "floor" else torch.where(byte == 254, math.inf, held)


def _gather_block_scales(job, local_scale: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """The full weight's (ceil(n / 32), K) scale from each rank's block scales: each rank
    sends the blocks that start in its rows (padded to ceil(chunk / 32)), one all-gather."""
    chunk = math.ceil(n / job.world)
    per_rank = math.ceil(chunk / MX_BLOCK)
    skip = math.ceil(start / MX_BLOCK) - start // MX_BLOCK  # a first block begun before
    own = local_scale[skip:] if job.shard.shape[0] else local_scale[:0]
    gathered = job.all_gather_rows(job.pad(own, per_rank))
    # block b comes from the rank holding its first row, r, which sent it as its
    # (b - ceil(r * chunk / 32))-th (index arithmetic on the device: no host copy)
    b = torch.arange(math.ceil(n / MX_BLOCK), device=gathered.device)
    r = b * MX_BLOCK // chunk
    return gathered[r * per_rank + b + (-(r * chunk)).div(MX_BLOCK, rounding_mode="floor")]
