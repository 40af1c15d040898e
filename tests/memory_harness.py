"""What the activation-memory tests share: a counter of the tensors autograd keeps alive,
and the recipes they compare. Not a test module."""

import gc
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from float8kit import CastConfig, Float8LinearConfig, ScalingType


def _storages(t: torch.Tensor):
    """The plain tensors holding ``t``'s memory (a subclass's inner tensors, recursively)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not nn.Parameter:
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _storages(getattr(t, name))
    else:
        yield t


class LiveTensors(TorchDispatchMode):
    """Remembers (weakly) every tensor the ops run under it return; ``live_bytes()`` is then
    the memory of those still alive: what a forward leaves for backward, including what no
    saved-tensor hook sees (a selective-checkpointing policy's cache)."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs += [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def live_bytes(self, exclude: nn.Module) -> int:
        """Bytes of the storages still alive, each once, less ``exclude``'s parameters and
        buffers."""
        gc.collect()
        skip = {t.untyped_storage().data_ptr() for t in (*exclude.parameters(), *exclude.buffers())}
        seen = {}
        for ref in self.refs:
            if (t := ref()) is not None:
                for inner in _storages(t):
                    storage = inner.untyped_storage()
                    if storage.data_ptr() not in skip:
                        seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())


def config(recipe: str) -> Float8LinearConfig:
    """A named recipe, or ``static``: STATIC input and weight (fixed scales), STATIC
    grad_output."""
    if recipe != "static":
        return Float8LinearConfig.from_recipe_name(recipe)

    def static(scale):
        return CastConfig(scaling_type=ScalingType.STATIC, static_scale=scale)

    return Float8LinearConfig(
        cast_config_input=static(448 / 4),
        cast_config_weight=static(448 / 0.1),
        cast_config_grad_output=static(2.0**12),
    )


RECIPES = ["tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp", "static", "blockwise"]
