"""float8kit: float8 training for PyTorch.

from float8kit import convert_to_float8_training, Float8LinearConfig, precompute_scales
"""

import torch

from float8kit import ops as _ops  # noqa: F401  (registers the op table)
from float8kit.calibrate import calibrate
from float8kit.checkpointing import checkpoint_policy, default_norm_filter, recompute_norms
from float8kit.config import (
    E4M3,
    E5M2,
    BlockwiseGranularity,
    CastConfig,
    Float8ExpertsConfig,
    Float8LinearConfig,
    Float8Recipe,
    Float8ReduceScatterConfig,
    GemmConfig,
    GemmRole,
    MXGranularity,
    NVFP4Granularity,
    ScalingGranularity,
    ScalingType,
    nvfp4_config,
)
from float8kit.convert import (
    convert_to_float8_training,
    default_module_filter,
    hp_tail_filter,
    set_hp_forward,
)
from float8kit.distributed.reduce_scatter import enable_float8_reduce_scatter
from float8kit.distributed.tp import (
    Float8ColwiseParallel,
    Float8RowwiseParallel,
    PrepareFloat8ModuleInput,
)
from float8kit.experts import (
    Float8ExpertWeight,
    convert_experts_to_float8_training,
    default_expert_filter,
)
from float8kit.formats import MX, NVFP4, Axiswise, Blockwise, Tensorwise
from float8kit.linear import Float8Linear
from float8kit.monitor import Float8Monitor
from float8kit.precompute import precompute_float8_dynamic_scale_for_fsdp, precompute_scales
from float8kit.roofline import auto_module_filter
from float8kit.state import Float8LoadPlanner, strip_float8_state
from float8kit.tensor import Float8TrainingTensor

__version__ = "0.1.0"

__all__ = [
    # converting a model
    "convert_to_float8_training",
    "default_module_filter",
    "auto_module_filter",
    "Float8Linear",
    # MoE expert weights (torch._grouped_mm / F.grouped_mm in float8)
    "convert_experts_to_float8_training",
    "default_expert_filter",
    "Float8ExpertsConfig",
    # configuration
    "Float8LinearConfig",
    "Float8Recipe",
    "CastConfig",
    "GemmConfig",
    "ScalingType",
    "ScalingGranularity",
    "BlockwiseGranularity",
    "MXGranularity",
    "NVFP4Granularity",
    "GemmRole",
    "E4M3",
    "E5M2",
    # NVFP4 (Blackwell): the recipe with its parts switchable, its hp-tail filter, and the
    # late-training switch of the forward gemms to hp
    "nvfp4_config",
    "hp_tail_filter",
    "set_hp_forward",
    # per-step scale update (DELAYED), calibration (STATIC)
    "precompute_scales",
    "precompute_float8_dynamic_scale_for_fsdp",
    "calibrate",
    # FSDP2 gradient reduce-scatter in blockwise float8 (qgZ)
    "enable_float8_reduce_scatter",
    "Float8ReduceScatterConfig",
    # tensor and sequence parallel (parallelize_module styles)
    "Float8ColwiseParallel",
    "Float8RowwiseParallel",
    "PrepareFloat8ModuleInput",
    # checkpoints: a DELAYED/STATIC model's state_dict for the plain model, and a DCP load
    # of a plain checkpoint into a DELAYED/STATIC model
    "strip_float8_state",
    "Float8LoadPlanner",
    # per-layer float8 numerics during training, with an opt-in hp fallback
    "Float8Monitor",
    # activation checkpointing: a selective policy that keeps the float8 work, and norms
    # recomputed in backward (activation memory of un-checkpointed blocks)
    "checkpoint_policy",
    "recompute_norms",
    "default_norm_filter",
    # internals users may meet (FSDP2 all-gathered weights, debugging)
    "Float8TrainingTensor",
    "Float8ExpertWeight",
]

# Anything of ours that can reach a pickle loads under torch.load(weights_only=True).
torch.serialization.add_safe_globals(
    [
        Float8TrainingTensor,
        Float8LinearConfig,
        Float8ExpertsConfig,
        Float8ReduceScatterConfig,
        CastConfig,
        GemmConfig,
        ScalingType,
        ScalingGranularity,
        BlockwiseGranularity,
        MXGranularity,
        NVFP4Granularity,
        GemmRole,
        Tensorwise,
        Axiswise,
        Blockwise,
        MX,
        NVFP4,
    ]
)
