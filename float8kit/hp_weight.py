"""What float8kit's hp weight wrappers share: identity, the ops that keep them, plain
state_dicts.

float8kit's parameter subclasses (``Float8AllGatherWeight`` of float8kit.distributed.fsdp,
``Float8ExpertWeight`` of float8kit.experts) wrap an hp tensor in ``_tensor``: every op runs on
it, the ops that keep "the weight" (``KEEP_SUBCLASS``) re-wrap their result, in-place ops
return the wrapper they mutated (``mutated_weights``), and a module's ``state_dict`` holds the
plain hp tensor (``store_plain_weight``). Not distributed by itself (an expert weight needs
none of FSDP2), so it sits in the core, where linear.py's ``state_dict`` can reach it.

Identity: the wrappers answer identity questions with their hp tensor's answers. A wrapper
owns no storage, so torch's ``data_ptr()`` would say 0 for every one of them, and trainers
that tell parameters apart by pointer (accelerate, mapping the optimizer's parameters to their
FSDP2-sharded replacements) would hold one weight several times and never update the others
(docs/trainers.md). ``HpIdentity`` makes ``data_ptr()`` the hp tensor's: distinct and
non-zero, before and after ``fully_shard``. torch reads ``data_ptr() == 0`` as "a wrapper
subclass" when it deep-copies and pickles a tensor: those two see 0 for their duration (on
this thread). ``id(p)`` is unaffected; ``p.data`` wraps the same hp tensor; no wrapper
subclass's ``untyped_storage()`` (DTensor's included) is an identity, and it is left as is.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor

from float8kit.tensor import wrap_local

aten = torch.ops.aten

_storage_less = threading.local()


class HpIdentity:
    """Mixin for a wrapper ``torch.Tensor`` subclass with its hp tensor in ``_tensor``."""

    _tensor: torch.Tensor

    def data_ptr(self) -> int:
        if getattr(_storage_less, "on", False):
            return 0
        return self._tensor.data_ptr()

    def __deepcopy__(self, memo):
        with _as_torch_sees_it():
            return super().__deepcopy__(memo)

    def __reduce_ex__(self, proto):
        with _as_torch_sees_it():
            return super().__reduce_ex__(proto)


class _as_torch_sees_it:
    """Report 0 from ``data_ptr()`` (torch's test for a storage-less wrapper) meanwhile."""

    def __enter__(self):
        self.old = getattr(_storage_less, "on", False)
        _storage_less.on = True

    def __exit__(self, *exc):
        _storage_less.on = self.old


# Ops whose result is still "the weight" (same values or a view/copy/pad of them), so it
# stays the wrapper: what FSDP2 does to a parameter while sharding, padding,
# offloading and re-padding it (new_zeros + slice + copy_, view, as_strided, split, _to_copy,
# pin_memory, ...). Every other op returns plain tensors: optimizer states, gradient
# clipping and any math on the weight see plain hp values.
KEEP_SUBCLASS = {
    aten.alias.default,
    aten.as_strided.default,
    aten.clone.default,
    aten.detach.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.view.default,
    aten._pin_memory.default,
    aten._to_copy.default,
}


def mutated_weights(func, args, kwargs, cls: type) -> Iterator[torch.Tensor]:
    """The ``cls`` arguments ``func`` writes to (per its schema)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, cls):
                yield t


class HpWeight(HpIdentity, torch.Tensor):
    """Base of float8kit's hp weight wrappers; internal.

    Invariants: ``_tensor`` is the plain tensor this stands for (same shape, strides,
    device; the dtype is ``hp_dtype`` where given, else ``_tensor``'s); ``_config`` is the
    owner's config. Every aten op runs on ``_tensor``: results of the ops in ``KEEP`` are
    re-wrapped, in-place ops return the wrapper they mutated, all else is plain.
    """

    _tensor: torch.Tensor
    KEEP = KEEP_SUBCLASS

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, config, scale=None, hp_dtype=None):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=hp_dtype or tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            pin_memory=tensor.is_pinned(),
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, config, scale=None, hp_dtype=None):
        self._tensor = tensor
        self._config = config

    # No torch_function override: ops reach __torch_dispatch__ after autograd.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        config = next(t._config for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls))
        inner_args, inner_kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs))
        out = func(*inner_args, **inner_kwargs)
        mutated = next(mutated_weights(func, args, kwargs, cls), None)
        if mutated is not None and isinstance(out, torch.Tensor):
            return mutated  # add_, copy_, ... return the tensor they mutated
        if func in cls.KEEP:
            return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, config), out)
        return out


def padded_shard_size(local: torch.Size, outer: torch.Size, world_size: int) -> torch.Size:
    """FSDP2's padded sharded size: ``torch.chunk`` sizes, where chunk 0 is the largest.

    The sharded dim is the one where the local size differs from the full size (FSDP2
    shards dim 0 unevenly, other dims only evenly, which need no padding)."""
    padded = list(local)
    for dim, (n_local, n_outer) in enumerate(zip(local, outer, strict=True)):
        if n_local != n_outer:
            padded[dim] = math.ceil(n_outer / world_size)
            break
    return torch.Size(padded)


def store_plain_weight(
    state_dict: dict, prefix: str, name: str = "weight", cls: type | None = None
) -> None:
    """In a module's freshly saved ``state_dict``: its weight ``name`` as plain hp values, not
    the wrapper subclass (``HpIdentity`` subclasses, or only ``cls`` when given).

    Unsharded: the hp tensor. Under FSDP2: a DTensor of the same mesh, placements and global
    shape around the hp shard. Both share storage with the parameter, so in-place loads into
    the state_dict (``torch.distributed.checkpoint.load``) update the weight; follow them with
    ``model.load_state_dict`` (or ``set_state_dict``), which bumps the parameter's version and
    so retires a precomputed scale, or with ``precompute_scales``. ``keep_vars=True`` keeps the
    parameter itself.
    """
    cls = cls or HpIdentity
    key = prefix + name
    value = state_dict.get(key)
    if value is None or isinstance(value, nn.Parameter):
        return
    if isinstance(value, cls):
        state_dict[key] = value._tensor
    elif isinstance(value, DTensor) and isinstance(value._local_tensor, cls):
        state_dict[key] = wrap_local(value._local_tensor._tensor, value)
