"""One float8 cast per shared input: linears that read the same hp tensor in one forward
(q/k/v, gate/up, any fan-out) share the float8 copy they keep for backward.

A DYNAMIC cast depends only on the hp tensor and the cast (its scale is the tensor's own
amax), so the first layer's cast is bitwise the one the next layer would make. The first
``Float8Linear`` to cast a tensor for its grad_weight gemm stores the float8 copy here; the
others reuse it, so autograd keeps one copy (one storage) for all of them.

The key:

- the tensor itself, held weakly (``WeakTensorKeyDictionary``): an entry dies with its hp
  tensor, never outlives it, and a new tensor at a recycled address is a new key;
- its version counter: an in-place change of the tensor means a new cast;
- the activation-checkpoint region (the top saved-tensor hooks, which
  ``torch.utils.checkpoint`` pushes per region and per recomputation): a recomputed forward
  makes its own casts exactly as the first forward did, so a selective-checkpointing cache
  replays the same op sequence;
- the cast (``CastConfig``, the layer's config, the gemm's inner dim, the hp dtype after
  autocast).

What is stored is only the copy backward keeps (tensorwise: the output gemm's cast, which
backward reuses; rowwise: the dim-0 cast of the grad_weight gemm), so the cache never holds
bytes that autograd does not hold anyway while the forward's tensors live. DELAYED and
STATIC casts are never shared: their scales are per layer. Not used under ``torch.compile``
(there AOTAutograd's common-subexpression elimination merges the identical cast ops of a
graph) nor without autograd (nothing is kept then).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from float8kit.config import CastConfig, Float8LinearConfig, ScalingType

_CASTS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def source_for(input: torch.Tensor) -> torch.Tensor | None:
    """The tensor a ``Float8Linear`` keys its shared casts on (its input as the caller passed
    it, before reshape and autocast), or None where no cast is shared: no autograd graph is
    being recorded, torch.compile is tracing, or the input is a subclass (tensor parallel
    DTensor, a float8 input)."""
    plain = type(input) in (torch.Tensor, torch.nn.Parameter)
    if not plain or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    return input


def shareable(cast: CastConfig) -> bool:
    """Whether a cast may be shared between layers: DYNAMIC only (its scale depends on the
    tensor alone)."""
    return cast.enabled and cast.scaling_type is ScalingType.DYNAMIC


def _state(source: torch.Tensor) -> tuple:
    # The region's pack hook, weakly: an entry must not keep a checkpoint frame alive.
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return (source._version, None if hooks is None else weakref.ref(hooks[0]))


def lookup(
    source: torch.Tensor | None,
    cast: CastConfig,
    reduce_dim: int,
    config: Float8LinearConfig,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """The float8 copy of ``source`` a layer already made for this cast in this forward
    (same version, same checkpoint region), or None."""
    if source is None or not shareable(cast):
        return None
    entry = _CASTS.get(source)
    if entry is None or entry[0] != _state(source):
        return None
    return entry[1].get((cast, reduce_dim, config, dtype))


def store(
    source: torch.Tensor | None,
    cast: CastConfig,
    reduce_dim: int,
    config: Float8LinearConfig,
    dtype: torch.dtype,
    fp8: torch.Tensor,
) -> None:
    """Remember ``fp8`` as ``source``'s cast for the next layers of this forward. Entries of
    an older version or another region of the same tensor are dropped."""
    if source is None or not shareable(cast):
        return
    state = _state(source)
    entry = _CASTS.get(source)
    if entry is None or entry[0] != state:
        entry = (state, {})
        _CASTS[source] = entry
    entry[1][(cast, reduce_dim, config, dtype)] = fp8


def clear() -> None:
    """Forget every shared cast (tests; the entries die with their tensors anyway)."""
    _CASTS.clear()
