"""float8 training in torchtitan 0.3: a model-config converter and a post-optimizer hook.

torchtitan 0.3 builds every model from a tree of ``Config`` dataclasses; a quantization
converter rewrites that tree before the model exists. The pieces here, in torchtitan's order:

- ``Float8KitConverter`` (a ``QuantizationConverter``): in ``model_registry(flavor,
  converters=[Float8KitConverter.Config(...)])`` it replaces each selected ``Linear.Config``
  by a ``Float8KitLinear.Config``, so the model is built with float8kit layers (on the meta
  device, before parallelization: convert first, then shard, as float8kit requires).
- ``Float8KitLinear``: float8kit's ``Float8Linear`` as a torchtitan ``Module``. torchtitan
  initializes a module's parameters from ``param_init`` (never calling
  ``reset_parameters``) and its buffers in ``_init_self_buffers``: that is where this layer
  writes its float8 scale state (DELAYED amax histories, STATIC scales), on the device given,
  so a model built on meta, moved with ``to_empty`` and initialized by ``init_states`` starts
  with the same state as one built on a real device.
- ``with_precompute(model_spec)``: sets ``ModelSpec.post_optimizer_build_fn`` (keeping any
  function the model had, e.g. the MoE load-balancing hook) to one that registers
  ``precompute_scales`` as a step post-hook of torchtitan's ``OptimizersContainer``: it runs
  once after every ``optimizer.step()`` of the trainer.
- ``llama3_debugmodel_float8kit``: a config-registry entry, for
  ``--module float8kit.integrations.torchtitan --config llama3_debugmodel_float8kit``.

Only this module imports torchtitan (``import float8kit`` never does).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from float8kit.integrations import missing_extra

try:
    import spmd_types as spmd
    from torchtitan.components.quantization import QuantizationConverter
    from torchtitan.models.common.linear import Linear
    from torchtitan.protocols.module import Module
except ModuleNotFoundError as e:
    raise missing_extra("torchtitan", e) from e

from float8kit import state
from float8kit.config import Float8LinearConfig
from float8kit.convert import default_module_filter
from float8kit.integrations import log_converted
from float8kit.linear import Float8Linear
from float8kit.precompute import precompute_scales

logger = logging.getLogger(__name__)

# Substrings of the fqns kept in hp by default: the output head (``lm_head`` in torchtitan's
# decoders; its logits feed a softmax over the vocabulary) and MoE routers (a flipped top-k
# choice moves a token to another expert). The same choice as float8kit.integrations.hf.
HP_FQNS = ("lm_head", "router")


class Float8KitLinear(Float8Linear, Module):
    """float8kit's ``Float8Linear`` built from a torchtitan config.

    Its ``Config`` extends torchtitan's ``Linear.Config`` (same fields, same ``param_init``
    and ``sharding_config``) with ``float8``, the layer's ``Float8LinearConfig``. Parameters,
    state_dict keys and forward are ``Float8Linear``'s.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        float8: Float8LinearConfig = field(default_factory=Float8LinearConfig)
        """How the layer casts and multiplies (float8kit's config)."""

        def to_dict(self) -> dict:
            # torchtitan json-dumps the whole config (debug.print_config): enums and
            # dtypes as their names
            d = Linear.Config.to_dict(self)
            d["float8"] = _plain(dataclasses.asdict(self.float8))
            return d

    def __init__(self, config: Config):
        Float8Linear.__init__(
            self, config.in_features, config.out_features, bias=config.bias, config=config.float8
        )

    def parallelize(self, parallel_dims) -> None:
        """torchtitan's ``Module.parallelize``, with the float8 scale state declared: its
        ``sharding_config`` (set for a Linear, e.g. by ``set_decoder_sharding_config``) names
        the weight and bias only, and every buffer needs a placement. The scale state is one
        per layer: replicated on every mesh axis the weight's placement names."""
        sc = self._sharding_config
        names = state.buffer_names(self.config)
        if sc is not None and any(n not in sc.state_shardings for n in names):
            from torchtitan.distributed.parallel_dims import SpmdLayout

            axes = dict.fromkeys(a for lay in sc.state_shardings.values() for a in lay.axes())
            replicated = SpmdLayout({a: spmd.R for a in axes})
            shardings = {n: replicated for n in names} | dict(sc.state_shardings)
            # a copy: one ShardingConfig object may serve several layers
            self._sharding_config = dataclasses.replace(sc, state_shardings=shardings)
        super().parallelize(parallel_dims)

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        """The float8 scale state at its initial values, on ``buffer_device`` if given (where
        torchtitan computes: a CPU-offloaded model keeps its buffers there)."""
        names = state.buffer_names(self.config)
        if buffer_device is not None:
            for name in names:
                buf = self._buffers[name]
                if buf.device != torch.device(buffer_device):
                    self._buffers[name] = torch.empty_like(buf, device=buffer_device)
        state.reset_state(self, self.config, names)


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value


class Float8KitConverter(QuantizationConverter):
    """Replaces selected ``Linear.Config`` entries of a torchtitan model config by
    ``Float8KitLinear.Config``.

    Selected: a plain ``Linear.Config`` (a subclass, e.g. a TP-specific Linear or another
    library's float8 Linear, has its own forward and stays as it is) whose fqn contains none
    of ``filter_fqns`` and whose dims the float8 kernels take (``default_module_filter``:
    multiples of 16, of 128 for blockwise casts). Converting a tree that already holds
    ``Float8KitLinear.Config`` entries with the same float8 config leaves them; another
    float8 config raises, as ``convert_to_float8_training`` does.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe_name: str = "tensorwise"
        """float8kit recipe (Float8LinearConfig.from_recipe_name): tensorwise, rowwise,
        rowwise_with_gw_hp, delayed or blockwise."""

        float8: Float8LinearConfig | None = None
        """A full Float8LinearConfig; when set, recipe_name is ignored."""

        filter_fqns: list[str] = field(default_factory=lambda: list(HP_FQNS))
        """Linears whose fqn contains any of these substrings stay in hp."""

    def __init__(self, config: Config):
        self.config = config
        self.float8 = config.float8 or Float8LinearConfig.from_recipe_name(config.recipe_name)
        self.converted: list[str] = []

    def keep_hp(self, linear: Linear.Config, fqn: str) -> bool:
        """Whether the Linear at ``fqn`` stays in hp (the filter ``convert`` applies)."""
        if any(s in fqn for s in self.config.filter_fqns):
            return True
        return not default_module_filter(linear, fqn, self.float8)

    def convert(self, model_config):
        self.converted = []
        n_linears = 0
        for fqn, linear, parent, attr in list(model_config.traverse(Linear.Config)):
            n_linears += 1
            if isinstance(linear, Float8KitLinear.Config):
                if linear.float8 != self.float8 and not self.keep_hp(linear, fqn):
                    raise ValueError(
                        f"Float8KitConverter: {fqn or '<root>'} is already a Float8KitLinear "
                        "with another float8 config; converting again does not change a "
                        "layer's config. Apply one Float8KitConverter, or add the fqn to "
                        "filter_fqns"
                    )
                self.converted.append(fqn)
                continue
            if type(linear) is not Linear.Config or self.keep_hp(linear, fqn):
                continue
            fields = {f.name: getattr(linear, f.name) for f in dataclasses.fields(linear)}
            new = Float8KitLinear.Config(**fields, float8=self.float8)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            self.converted.append(fqn)
        log_converted(logger, len(self.converted), n_linears)
        return model_config


def register_precompute_hook(
    optimizers: torch.optim.Optimizer, model_parts: list[nn.Module], parallel_dims=None
) -> Callable[..., None]:
    """Register ``precompute_scales`` over ``model_parts`` as a step post-hook of
    ``optimizers`` (torchtitan's ``OptimizersContainer``, or any optimizer): one call, with
    at most one collective, after every step. The signature is torchtitan's
    ``post_optimizer_build_fn``'s. Returns the hook (its ``calls`` attribute counts them)."""
    model = model_parts[0] if len(model_parts) == 1 else nn.ModuleList(model_parts)

    def hook(optimizer, args, kwargs) -> None:
        precompute_scales(model)
        hook.calls += 1

    hook.calls = 0
    hook.handle = optimizers.register_step_post_hook(hook)
    return hook


def with_precompute(model_spec):
    """``model_spec`` with a ``post_optimizer_build_fn`` that registers the float8kit
    precompute hook (``register_precompute_hook``) after running the model's own, if any.
    Idempotent; returns ``model_spec`` (changed in place)."""
    previous = model_spec.post_optimizer_build_fn
    if getattr(previous, "float8kit_precompute", False):
        return model_spec

    def post_optimizer_build_fn(optimizers, model_parts, parallel_dims) -> None:
        if previous is not None:
            previous(optimizers, model_parts, parallel_dims)
        post_optimizer_build_fn.hook = register_precompute_hook(
            optimizers, model_parts, parallel_dims
        )

    post_optimizer_build_fn.float8kit_precompute = True
    model_spec.post_optimizer_build_fn = post_optimizer_build_fn
    return model_spec


# ---------------------------------------------------------------------------- config registry


def llama3_debugmodel_float8kit():
    """torchtitan's ``llama3_debugmodel`` with float8kit (tensorwise; ``lm_head`` in hp).

    torchtitan --module float8kit.integrations.torchtitan --config llama3_debugmodel_float8kit
    """
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    compiled = config.compile.enable and "model" in config.compile.components
    converter = Float8KitConverter.Config(recipe_name="tensorwise", model_compile_enabled=compiled)
    config.model_spec = with_precompute(model_registry("debugmodel", converters=[converter]))
    return config
