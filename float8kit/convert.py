"""``convert_to_float8_training``: swap ``nn.Linear`` modules for ``Float8Linear``."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

from torch import nn

from float8kit import formats
from float8kit.config import Float8LinearConfig, config_name
from float8kit.linear import Float8Linear

ModuleFilter = Callable[[nn.Module, str], bool]


def default_module_filter(
    module: nn.Module, fqn: str, config: Float8LinearConfig | None = None
) -> bool:
    """Convert a Linear only when both its dims are multiples of 16: the CUDA float8 gemm
    needs that, and layers that small gain nothing from float8 anyway. With a ``config``
    that casts blockwise (the ``blockwise`` recipe), multiples of its block size (128): the
    block-scaled kernel tiles both dims of the weight in whole blocks; with MX casts (the
    ``mxfp8`` recipe), multiples of 32 (``required_multiple``)."""
    multiple = required_multiple(config) if config is not None else 16
    return module.in_features % multiple == 0 and module.out_features % multiple == 0


def required_multiple(config: Float8LinearConfig) -> int:
    """What both dims of a layer with ``config`` must be multiples of: 16 (CUDA's float8
    gemms), or what a cast's format needs (``Format.filter_multiple``): the block size of
    blockwise casts (128), 32 for MX casts (one e8m0 scale per 32 elements along each layer
    dim: in_features is the output gemm's K, out_features the grad_input gemm's), 32 for
    NVFP4 casts (the CUDA kernel's K: 16 bytes of packed e2m1)."""
    multiple = 16
    for _, cast in formats.enabled_casts(config):
        multiple = math.lcm(
            multiple, formats.FORMATS[cast.scaling_granularity].filter_multiple(cast)
        )
    return multiple


def hp_tail_filter(
    model: nn.Module,
    fraction: float = 0.15,
    config: Float8LinearConfig | None = None,
    base: ModuleFilter | None = None,
) -> ModuleFilter:
    """A module filter that keeps the last ``fraction`` of ``model``'s float8 candidates in hp
    (the NVFP4 paper keeps about 15% of the linear layers, mostly the last ones, in bf16).

    The candidates are the ``nn.Linear`` modules ``base`` accepts (default:
    ``default_module_filter`` for ``config``), in ``model.named_modules()`` order (a model's
    definition order: for a transformer, its blocks from first to last); the last
    ``round(fraction * count)`` of them stay hp, the others follow ``base``. Build it from the
    model before ``convert_to_float8_training``, which it is then passed to, with the same
    ``config`` (conversion with another config refuses a default-based one)."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise ValueError(f"hp_tail_filter: fraction={fraction!r} must be a number in [0, 1]")
    if not 0 <= fraction <= 1:
        raise ValueError(f"hp_tail_filter: fraction={fraction!r} must be in [0, 1]")
    default = functools.partial(default_module_filter, config=config)
    base = base or default
    candidates = [
        fqn for fqn, mod in model.named_modules() if isinstance(mod, nn.Linear) and base(mod, fqn)
    ]
    tail = set(candidates[len(candidates) - round(fraction * len(candidates)) :])

    def keep(mod: nn.Module, fqn: str) -> bool:
        return fqn not in tail and base(mod, fqn)

    keep.hp_tail = sorted(tail, key=candidates.index)  # what it keeps in hp, for reports
    # the config whose default filter chose the candidates (convert checks it is its own)
    keep.hp_tail_config = None if base is not default else (config or Float8LinearConfig())
    return keep


def set_hp_forward(model: nn.Module, enabled: bool = True) -> int:
    """Switch every ``Float8Linear`` of ``model`` to an hp output gemm (``enabled``) or back
    (the NVFP4 paper's late-training switch of the forward gemms to bf16; the backward gemms
    keep their casts): ``Float8LinearConfig.with_hp_forward``. Returns how many layers it
    switched. A compiled model recompiles once for the new configs. Switching back restores
    each layer's config from before the first switch. All or nothing: a layer that cannot
    switch (DELAYED/STATIC scaling) raises, naming it, before any layer is switched."""
    if not isinstance(enabled, bool):
        raise TypeError(f"float8kit: set_hp_forward(enabled=...) takes a bool, got {enabled!r}")
    switches = []  # (layer, its new config, the config to restore later or None)
    for fqn, mod in model.named_modules():
        if not isinstance(mod, Float8Linear):
            continue
        original = mod.__dict__.get("_config_before_hp_forward")
        if enabled and original is None:
            try:
                switches.append((mod, mod.config.with_hp_forward(), mod.config))
            except ValueError as e:
                raise ValueError(
                    f"float8kit: set_hp_forward: {fqn or '<root>'} cannot switch (no layer was "
                    f"switched): {e}"
                ) from None
        elif not enabled and original is not None:
            switches.append((mod, original, None))
    for mod, config, restore in switches:
        if restore is None:
            del mod.__dict__["_config_before_hp_forward"]
        else:
            mod.__dict__["_config_before_hp_forward"] = restore
        mod.config = config
    return len(switches)


def check_layer_dims(linear: nn.Module, config: Float8LinearConfig, fqn: str = "") -> None:
    """Raise naming the layer and the config field when a cast's format needs both layer dims
    to be multiples of something (``Capabilities.layer_multiple``: MX, one e8m0 scale per 32
    elements along each; NVFP4, the kernel's K of 32) and ``linear``'s are not. Other formats
    run any shape on CPU and say what CUDA needs at the gemm (``float8kit.gemm.kernel_plan``)."""
    for field, cast in formats.enabled_casts(config):
        multiple = formats.capabilities(cast).layer_multiple
        if multiple is None:
            continue
        bad = [
            f"{name}={getattr(linear, name)}"
            for name in ("in_features", "out_features")
            if getattr(linear, name) % multiple
        ]
        if bad:
            kind = cast.scaling_granularity.value.upper()
            raise ValueError(
                f"float8kit: {fqn or '<root>'} ({', '.join(bad)}) cannot run {kind} gemms: "
                f"Float8LinearConfig.{field} casts {kind}, which needs in_features and "
                f"out_features to be multiples of {multiple}; keep it in hp with "
                "module_filter_fn (the default filter does: default_module_filter(mod, fqn, "
                "config))"
            )


def _refuse_sharded(linear: nn.Module, fqn: str) -> None:
    """Raise if ``linear`` was already sharded (``fully_shard``) or parallelized: its
    parameters are DTensors, which the float8 conversion cannot wrap."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    params = list(linear.parameters(recurse=False))
    if isinstance(linear, FSDPModule) or any(isinstance(p, DTensor) for p in params):
        raise RuntimeError(
            f"convert_to_float8_training: {fqn or '<root>'} is already sharded or parallelized "
            "(fully_shard / parallelize_module made its parameters DTensors): convert before "
            "fully_shard / parallelize_module, i.e. call convert_to_float8_training(model) "
            "first, then fully_shard / parallelize_module"
        )


def convert_to_float8_training(
    module: nn.Module,
    *,
    config: Float8LinearConfig | None = None,
    module_filter_fn: ModuleFilter | None = None,
) -> nn.Module:
    """Swap every ``nn.Linear`` in ``module`` (the root too) for a ``Float8Linear``, in place.

    Every ``nn.Linear`` means every one: the root, and Linears nested inside other Linears
    (e.g. adapters registered as a Linear's submodules), which keep their place in the tree.
    Call it before ``fully_shard`` / ``parallelize_module``: an already sharded layer raises.

    Args:
        module: any module; its Linear submodules are replaced in their parents, and a root
            ``nn.Linear`` has its class swapped in place, so the returned object is ``module``.
        config: how the new layers cast and multiply; default: dynamic tensorwise.
        module_filter_fn: ``fn(linear, fqn) -> bool``; False keeps that layer in hp. It
            replaces the default filter (dims divisible by 16, by 128 for blockwise casts),
            so a custom filter that wants that rule too should call
            ``default_module_filter(linear, fqn, config)``. It also sees layers that are
            already ``Float8Linear``.

    Returns:
        ``module``, converted.

    Raises:
        ValueError: a layer the filter selects is already a ``Float8Linear`` with another
            config. Converting again with the same config is a no-op (never a double wrap);
            a different config is refused rather than silently ignored or silently
            re-initialising that layer's scale state. Nothing is changed when it raises.
        RuntimeError: a layer to convert is already sharded or parallelized (DTensor
            parameters).
    """
    config = config if config is not None else Float8LinearConfig()
    if not isinstance(config, Float8LinearConfig):
        raise TypeError(f"config must be a Float8LinearConfig, got {config_name(config)}")
    keep = module_filter_fn or functools.partial(default_module_filter, config=config)
    built_for = getattr(keep, "hp_tail_config", None)
    if built_for is not None and built_for != config:
        raise ValueError(
            "float8kit: this hp_tail_filter chose its candidates with the default filter of "
            "another config than this conversion's (the layers it would convert are not the "
            "ones it counted; an nvfp4 conversion needs dims that are multiples of 32): build "
            "it with hp_tail_filter(model, fraction, config=<this conversion's config>)"
        )

    # Plan the whole tree first, so that an error leaves the model untouched.
    plan: list[tuple[nn.Module | None, str, nn.Linear]] = []  # (parent, name, linear)

    def visit(parent: nn.Module | None, name: str, fqn: str, mod: nn.Module) -> None:
        if isinstance(mod, nn.Linear) and keep(mod, fqn):
            if not isinstance(mod, Float8Linear):
                _refuse_sharded(mod, fqn)
                check_layer_dims(mod, config, fqn)
                plan.append((parent, name, mod))
            elif mod.config != config:
                raise ValueError(
                    f"convert_to_float8_training: {fqn or '<root>'} is already a "
                    f"Float8Linear with another config ({mod.extra_repr()}); converting "
                    "again does not change a layer's config. Convert the plain model once "
                    "with the config you want, or pass a module_filter_fn that leaves the "
                    "converted layers out (e.g. lambda mod, fqn: not isinstance(mod, "
                    "Float8Linear))"
                )
        for child_name, child in mod.named_children():
            visit(mod, child_name, f"{fqn}.{child_name}" if fqn else child_name, child)

    visit(None, "", "", module)
    _warn_if_nothing_converted(module, plan, module_filter_fn, config)
    if config.enable_fsdp_float8_all_gather:
        _refuse_ties_with_unconverted(module, {id(linear) for _, _, linear in plan})
    # Innermost first: a Linear nested in a Linear is swapped before its parent, which then
    # carries the converted child over.
    for parent, name, linear in reversed(plan):
        if parent is None:
            # In place: the caller's reference stays valid and hooks/children are untouched.
            linear.__class__ = Float8Linear
            linear._init_float8(config)
        else:
            new = Float8Linear.from_float(linear, config=config)
            new._modules.update(linear._modules)
            setattr(parent, name, new)
    return module


def _warn_if_nothing_converted(module, plan, module_filter_fn, config) -> None:
    """A model with Linears of which the filter took none trains in hp: say so, and why."""
    linears = [(fqn, m) for fqn, m in module.named_modules() if isinstance(m, nn.Linear)]
    if plan or not linears or any(isinstance(m, Float8Linear) for _, m in linears):
        return
    fqn, m = linears[0]
    why = (
        "module_filter_fn returned False for every one"
        if module_filter_fn is not None
        else f"the default filter converts layers whose in_features and out_features are both "
        f"multiples of {required_multiple(config)} under this config"
    )
    warnings.warn(
        f"float8kit: convert_to_float8_training converted none of the {len(linears)} Linears "
        f"({why}; e.g. {fqn or '<root>'}: in_features={m.in_features}, "
        f"out_features={m.out_features}): the model trains in hp",
        UserWarning,
        stacklevel=3,
    )


def _refuse_ties_with_unconverted(module: nn.Module, converting: set[int]) -> None:
    """With float8 all-gather a converted weight becomes a new parameter (a subclass on the
    same storage); a module that is not converted and shares it (an embedding tied to the
    output head) would keep the old one: two parameters on one storage, updated twice."""
    converted = {id(m.weight): fqn for fqn, m in module.named_modules() if id(m) in converting}
    for fqn, mod in module.named_modules(remove_duplicate=False):
        if id(mod) in converting:
            continue
        for name, param in mod.named_parameters(recurse=False):
            if id(param) in converted:
                raise ValueError(
                    f"float8kit: {fqn or '<root>'}.{name} is tied to the weight of "
                    f"{converted[id(param)] or '<root>'}, which enable_fsdp_float8_all_gather "
                    "would wrap in a new parameter and so untie. Keep that layer in hp "
                    "(module_filter_fn) or set enable_fsdp_float8_all_gather=False"
                )
