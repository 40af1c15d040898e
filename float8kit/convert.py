"""``convert_to_float8_training``: swap ``nn.Linear`` modules for ``Float8Linear``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from float8kit.config import Float8LinearConfig
from float8kit.linear import Float8Linear

ModuleFilter = Callable[[nn.Module, str], bool]


def default_module_filter(module: nn.Module, fqn: str) -> bool:
    """Convert a Linear only when both its dims are multiples of 16: the CUDA float8 gemm
    needs that, and layers that small gain nothing from float8 anyway."""
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_float8_training(
    module: nn.Module,
    *,
    config: Float8LinearConfig | None = None,
    module_filter_fn: ModuleFilter | None = None,
) -> nn.Module:
    """Swap every ``nn.Linear`` in ``module`` (the root too) for a ``Float8Linear``, in place.

    Args:
        module: any module; its Linear submodules are replaced in their parents, and a root
            ``nn.Linear`` has its class swapped in place, so the returned object is ``module``.
        config: how the new layers cast and multiply; default: dynamic tensorwise.
        module_filter_fn: ``fn(linear, fqn) -> bool``; False keeps that layer in hp. It
            replaces the default filter (dims divisible by 16), so a custom filter that wants
            that rule too should call ``default_module_filter``.

    Returns:
        ``module``, converted. Already converted layers are left alone (no double wrap).
    """
    config = config if config is not None else Float8LinearConfig()
    if not isinstance(config, Float8LinearConfig):
        raise TypeError(f"config must be a Float8LinearConfig, got {type(config).__name__}")
    keep = module_filter_fn if module_filter_fn is not None else default_module_filter

    def eligible(mod: nn.Module, fqn: str) -> bool:
        return isinstance(mod, nn.Linear) and not isinstance(mod, Float8Linear) and keep(mod, fqn)

    if config.enable_fsdp_float8_all_gather:
        _refuse_ties_with_unconverted(module, eligible)

    if eligible(module, ""):
        # In place: the caller's reference stays valid and hooks/parameters are untouched.
        module.__class__ = Float8Linear
        module._init_float8(config)
        return module

    def swap(parent: nn.Module, prefix: str) -> None:
        for name, child in parent.named_children():
            fqn = f"{prefix}.{name}" if prefix else name
            if eligible(child, fqn):
                setattr(parent, name, Float8Linear.from_float(child, config=config))
            elif not isinstance(child, Float8Linear):
                swap(child, fqn)

    swap(module, "")
    return module


def _refuse_ties_with_unconverted(module: nn.Module, eligible: ModuleFilter) -> None:
    """With float8 all-gather a converted weight becomes a new parameter (a subclass on the
    same storage); a module that is not converted and shares it (an embedding tied to the
    output head) would keep the old one: two parameters on one storage, updated twice."""
    converted = {id(m.weight): fqn for fqn, m in module.named_modules() if eligible(m, fqn)}
    for fqn, mod in module.named_modules(remove_duplicate=False):
        if eligible(mod, fqn):
            continue
        for name, param in mod.named_parameters(recurse=False):
            if id(param) in converted:
                raise ValueError(
                    f"float8kit: {fqn or '<root>'}.{name} is tied to the weight of "
                    f"{converted[id(param)] or '<root>'}, which enable_fsdp_float8_all_gather "
                    "would wrap in a new parameter and so untie. Keep that layer in hp "
                    "(module_filter_fn) or set enable_fsdp_float8_all_gather=False"
                )
