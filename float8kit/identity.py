"""Parameter subclasses that answer identity questions with their hp tensor's answers.

float8kit's parameter subclasses (``Float8AllGatherWeight``, ``Float8ExpertWeight``) are
wrapper subclasses: they own no storage, so torch's ``data_ptr()`` says 0 for every one of
them. Trainers identify parameters by pointer: accelerate maps the optimizer's parameters
to their FSDP2-sharded replacements by ``data_ptr()``, so with several such weights all
keyed 0 the optimizer ends up holding one weight many times and never updates the others,
silently. ``HpIdentity`` makes ``data_ptr()`` the wrapped hp tensor's pointer: distinct and
non-zero per parameter, before and after ``fully_shard`` (whose local shard is the subclass).

torch itself reads ``data_ptr() == 0`` as "a wrapper subclass" when it deep-copies and
pickles a tensor (``Tensor.__deepcopy__``, ``Tensor._reduce_ex_internal``): those two go
through torch's own wrapper-subclass route here, as before, with the pointer reported as 0
only for their duration (on this thread).

Audit of the other identity APIs a trainer may use:
    - ``id(p)`` and ``p is q``: the parameter object; unaffected.
    - ``p.data``: a new wrapper around the same hp tensor, so ``p.data.data_ptr()`` equals
      ``p.data_ptr()``.
    - ``p.untyped_storage()``: the wrapper's (empty) storage; its ``data_ptr()`` raises in
      torch ("invalid python storage"): it is not an identity for any wrapper subclass
      (DTensor included), and is left as torch makes it.
    - ``p.is_set_to(p)``: True, as for any tensor.
"""

from __future__ import annotations

import threading

import torch

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
