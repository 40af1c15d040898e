"""qgZ: FSDP2's gradient reduce-scatter sent as blockwise-scaled float8 over one all-to-all.

ZeRO++ (qgZ) cuts gradient traffic by quantizing what each rank sends and reducing in high
precision on arrival. FSDP2 lets a module replace its reduce-scatter
(``FSDPModule.set_custom_reduce_scatter``); ``Float8ReduceScatter`` is that replacement:

1. the rank's flat reduce-scatter input (``world`` equal chunks, one per destination rank,
   FSDP2's padding included) is cut into blocks of ``block_size`` elements per chunk (the
   last one zero-padded); each block gets ``scale = fp8_max / amax`` and is cast to float8;
2. per destination: the float8 bytes then the fp32 scales' bytes, all as uint8 (gloo
   carries no float8 dtype), exchanged with one ``all_to_all_single``;
3. the receiver dequantizes the ``world`` chunks it got, sums them in fp32 and applies the
   reduce op's factor (SUM, AVG, or FSDP2's PREMUL_SUM divide factor), then writes the
   result in the reduce dtype FSDP2 asked for.

Bytes sent per gradient element: ``1 + 4 / block_size`` (1.03 for 128) against 4 for an
fp32 reduce-scatter and 2 for bf16. A block holding inf or NaN gets an inf/NaN amax, so the
whole block arrives as NaN: non-finite gradients stay visible (GradScaler skips the step).
HSDP's replicate all-reduce runs after the reduce-scatter and stays in the reduce dtype.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from float8kit import versions
from float8kit.cast import cast_last_dim_blocks
from float8kit.config import Float8ReduceScatterConfig, config_name

_SCALE_BYTES = 4  # fp32


def payload_bytes(chunk_numel: int, config: Float8ReduceScatterConfig) -> int:
    """Bytes one rank sends to one destination for a chunk of ``chunk_numel`` elements."""
    n_blocks = -(-chunk_numel // config.block_size)
    return n_blocks * (config.block_size + _SCALE_BYTES)


def quantize_chunks(flat: torch.Tensor, world: int, config: Float8ReduceScatterConfig):
    """A rank's flat reduce-scatter input as ``(world, payload_bytes)`` uint8: row ``r`` is
    chunk ``r`` in float8 blocks followed by its fp32 block scales."""
    chunk = flat.numel() // world
    block = config.block_size
    n_blocks = -(-chunk // block)
    hp = flat.view(world, chunk).to(torch.float32)
    if n_blocks * block != chunk:
        hp = torch.nn.functional.pad(hp, (0, n_blocks * block - chunk))
    hp = hp.view(world, n_blocks, block)
    # a block with a non-finite value arrives all NaN (see cast_last_dim_blocks)
    data, scale = cast_last_dim_blocks(hp, config.dtype, config.round_scales_to_power_of_2)
    payload = torch.empty(
        world, payload_bytes(chunk, config), dtype=torch.uint8, device=flat.device
    )
    payload[:, : n_blocks * block] = data.view(torch.uint8).view(world, n_blocks * block)
    payload[:, n_blocks * block :] = scale.view(torch.uint8)
    return payload


def dequantize_sum(received: torch.Tensor, chunk: int, config: Float8ReduceScatterConfig):
    """The fp32 sum of the ``world`` chunks in ``received`` (``(world, payload_bytes)`` uint8,
    one row per sending rank), ``chunk`` elements."""
    world = received.shape[0]
    block = config.block_size
    n_blocks = -(-chunk // block)
    data = received[:, : n_blocks * block].view(config.dtype).to(torch.float32)
    scale = received[:, n_blocks * block :].contiguous().view(torch.float32)
    hp = data.view(world, n_blocks, block) / scale[..., None]
    return hp.sum(dim=0).view(-1)[:chunk]


def _op_factor(op, group_size: int, divide_factor: float | None = None) -> float:
    """What a reduce op multiplies the sum by: SUM 1, AVG 1/size, PREMUL_SUM its factor
    (on torch 2.11, whose ``ReduceOp`` keeps that factor in C++, ``1 / divide_factor``: the
    FSDP2 module's gradient divide factor, which is what FSDP2 built the op from)."""
    kind = op if isinstance(op, dist.ReduceOp.RedOpType) else op.op
    if kind == dist.ReduceOp.SUM:
        return 1.0
    if kind == dist.ReduceOp.AVG:
        return 1.0 / group_size
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = versions.premul_sum_factor(op)
        if factor is not None:
            return factor
        if divide_factor is None:
            raise ValueError(
                f"float8 reduce-scatter cannot read a PREMUL_SUM factor in torch "
                f"{torch.__version__} and was given no FSDP2 module to read the gradient "
                "divide factor from: enable it with enable_float8_reduce_scatter(model)"
            )
        return 1.0 / divide_factor
    raise ValueError(
        f"float8 reduce-scatter supports SUM, AVG and PREMUL_SUM gradient reductions, got {op}"
    )


class Float8ReduceScatter(ReduceScatter):
    """FSDP2 ``ReduceScatter`` comm that sends blockwise float8 and sums in fp32 on arrival.

    Invariants: ``output_tensor`` ends up holding ``factor * sum_over_ranks(dequant(chunk))``
    in its own dtype (FSDP2's reduce dtype); the one collective is an ``all_to_all_single`` of
    uint8 bytes, equal splits, so gloo, NCCL and any backend with all-to-all carry it.
    """

    def __init__(self, config: Float8ReduceScatterConfig, owner: FSDPModule | None = None):
        self.config = config
        # the FSDP2 module this comm reduces for (weakly): its gradient divide factor is
        # PREMUL_SUM's factor where torch does not show it on the op (torch 2.11)
        self._owner = weakref.ref(owner) if owner is not None else None

    def _divide_factor(self) -> float | None:
        owner = self._owner() if self._owner is not None else None
        group = owner._get_fsdp_state()._fsdp_param_group if owner is not None else None
        return None if group is None else group.gradient_divide_factor

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        async_op: bool = False,
    ):
        if async_op:
            raise NotImplementedError(
                "float8 reduce-scatter runs synchronously (the fp32 sum needs the received "
                "bytes); FSDP2 calls it with async_op=False"
            )
        world = group.size()
        chunk = output_tensor.numel()
        if input_tensor.numel() != chunk * world:
            raise ValueError(
                f"reduce-scatter input has {input_tensor.numel()} elements, expected "
                f"{chunk} x {world} ranks"
            )
        factor = _op_factor(op, world, self._divide_factor())
        send = quantize_chunks(input_tensor.reshape(-1), world, self.config)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        reduced = dequantize_sum(received, chunk, self.config)
        if factor != 1.0:
            reduced = reduced * factor
        output_tensor.view(-1).copy_(reduced)
        return None


def enable_float8_reduce_scatter(
    module: nn.Module, *, config: Float8ReduceScatterConfig | None = None
) -> nn.Module:
    """Send every FSDP2 module's gradient reduce-scatter as blockwise float8 (qgZ).

    Call it once on the root after ``fully_shard`` has wrapped the blocks and the root. Every
    ``FSDPModule`` under ``module`` (the root included) gets a ``Float8ReduceScatter``; the
    averaging, ``set_gradient_divide_factor`` and ``MixedPrecisionPolicy.reduce_dtype`` keep
    their meaning, and an HSDP replicate all-reduce stays in the reduce dtype.

    Args:
        module: the root module ``fully_shard`` returned.
        config: block size, float8 dtype and scale rounding (default: e4m3, 128-element
            blocks, fp32 scales).

    Returns:
        ``module``. A second call with the same config changes nothing.
    """
    config = config or Float8ReduceScatterConfig()
    if not isinstance(config, Float8ReduceScatterConfig):
        raise TypeError(f"config must be a Float8ReduceScatterConfig, got {config_name(config)}")
    if not isinstance(module, FSDPModule):
        has_fsdp = any(isinstance(m, FSDPModule) for m in module.modules())
        where = (
            "only modules inside it are FSDP2 modules: call fully_shard(model) on the root too "
            "(or pass the root that fully_shard wrapped)"
            if has_fsdp
            else "it is not sharded with FSDP2: call fully_shard on the blocks and the root first"
        )
        raise ValueError(
            f"enable_float8_reduce_scatter got a {type(module).__name__} but {where}, then "
            "enable_float8_reduce_scatter(model)"
        )
    current = getattr(module, "_float8_reduce_scatter", None)
    if current is not None:
        if current.config != config:
            raise ValueError(
                f"float8 reduce-scatter is already enabled on this model with {current.config}; "
                f"a second call with a different config ({config}) is refused"
            )
        return module
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_custom_reduce_scatter(Float8ReduceScatter(config, owner=sub))
    module._float8_reduce_scatter = Float8ReduceScatter(config)  # records the config
    return module
