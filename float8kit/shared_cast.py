"""One float8 cast per shared input: linears that read the same hp tensor in one forward
(q/k/v, gate/up, any fan-out) share the float8 copy they keep for backward.

A DYNAMIC cast depends only on the hp tensor and the cast (its scale is the tensor's own
amax), so the first layer's cast is bitwise the one the next layer would make. The first
``Float8Linear`` to cast a tensor for its grad_weight gemm stores the float8 copy here; the
others reuse it, so autograd keeps one copy (one storage) for all of them.

The key:

- the tensor itself, by identity and held weakly (a weak reference whose callback drops the
  entry): an entry dies with its hp tensor, never outlives it, and a new tensor at a
  recycled address is a new key;
- its version counter: an in-place change of the tensor means a new cast;
- the activation-checkpoint region (the top saved-tensor hooks, which
  ``torch.utils.checkpoint`` pushes per region and per recomputation): a recomputed forward
  makes its own casts exactly as the first forward did, so a selective-checkpointing cache
  replays the same op sequence;
- the cast (``CastConfig``, the layer's config, the gemm's inner dim, the hp dtype after
  autocast).

What is stored is only the copy backward keeps (tensorwise: the output gemm's cast, which
backward reuses; rowwise: the dim-0 cast of the grad_weight gemm), so the cache never holds
bytes that autograd does not hold anyway while the forward's tensors live.

A DELAYED cast depends on the tensor and the layer's scale buffer, so it is keyed on a scale
buffer too (its identity and version): the caster's own, or, for a layer tied to the first
layer that cast the tensor in this forward (``delayed_owner``; ``state.tie_input`` compares
their states and ties them where equal, ``state.Tie`` keeps only what stays equal), that
layer's, whose scale equals its own. A layer that reuses such a cast records into its own
amax record the amax stored with it, so every cast, record and scale update is the one each
layer would have made alone. ``read_id`` names the tensors a tied layer records, for the
tie's bookkeeping. STATIC casts are never shared. Not used under ``torch.compile`` (there
AOTAutograd's common-subexpression elimination merges the identical cast ops of a graph) nor
without autograd (nothing is kept then).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from float8kit.config import CastConfig, Float8LinearConfig, ScalingType

# id(tensor) -> (weak reference to it, its state, {cast key: entry}). A plain dict: a
# ``WeakTensorKeyDictionary`` costs a few microseconds of Python per access, on every
# forward of every layer.
_CASTS: dict[int, tuple] = {}
_READ_IDS = itertools.count()


def source_for(input: torch.Tensor) -> torch.Tensor | None:
    """The tensor a ``Float8Linear`` keys its shared casts on (its input as the caller passed
    it, before reshape and autocast), or None where no cast is shared: no autograd graph is
    being recorded, torch.compile is tracing, or the input is a subclass (tensor parallel
    DTensor, a float8 input)."""
    return read_source(input) if torch.is_grad_enabled() else None


def read_source(input: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose reads a tied layer notes (``read_id``): its input as passed, also
    without autograd; None for a tensor subclass or while torch.compile traces (an untracked
    read, which ends that layer's tie at the next scale update)."""
    plain = type(input) in (torch.Tensor, torch.nn.Parameter)
    return input if plain and not torch.compiler.is_compiling() else None


def read_id(source: torch.Tensor) -> int:
    """One id per tensor read (same tensor, version and checkpoint region), never reused."""
    entry = _entry(source, create=True)
    if "read" not in entry:
        entry["read"] = next(_READ_IDS)
    return entry["read"]


def shareable(cast: CastConfig, scale: torch.Tensor | None = None) -> bool:
    """Whether a cast may be shared between layers: DYNAMIC (its scale depends on the tensor
    alone), or DELAYED with its scale buffer ``scale`` (shared between layers whose input
    state is tied, see ``state.tie_input``)."""
    if not cast.enabled:
        return False
    if cast.scaling_type is ScalingType.DELAYED:
        return scale is not None
    return cast.scaling_type is ScalingType.DYNAMIC


def _key(cast, reduce_dim, config, dtype, scale) -> tuple:
    # A DELAYED cast: the scale buffer by identity (the entry keeps it alive, so the id is not
    # reused while the entry lives) and version (precompute_scales writes it in place). Not
    # the tensor itself: a tuple compares its items with ==, which for tensors compares values.
    # The cast and config by identity too (the entry keeps them alive): hashing a config walks
    # every field, on every call; Float8Linear passes its interned config (one object per
    # distinct config) and that config's casts.
    state = None if scale is None else (id(scale), scale._version)
    return (id(cast), reduce_dim, id(config), dtype, state)


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
    scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The float8 copy of ``source`` a layer already made for this cast in this forward
    (same version, same checkpoint region; DELAYED: the same scale buffer ``scale``) and the
    amax its cast recorded (None if it recorded none), or None."""
    if source is None or not shareable(cast, scale):
        return None
    hit = _entry(source, create=False).get(_key(cast, reduce_dim, config, dtype, scale))
    return None if hit is None else (hit[0], hit[2])


def _entry(source: torch.Tensor, create: bool) -> dict:
    state, key = _state(source), id(source)
    entry = _CASTS.get(key)
    if entry is None or entry[0]() is not source or entry[1] != state:
        if not create:
            return {}
        # (the tensor's death drops the entry, before anything else can take its address)
        entry = (weakref.ref(source, lambda _, k=key: _CASTS.pop(k, None)), state, {})
        _CASTS[key] = entry
    return entry[2]


def store(
    source: torch.Tensor | None,
    cast: CastConfig,
    reduce_dim: int,
    config: Float8LinearConfig,
    dtype: torch.dtype,
    fp8: torch.Tensor,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> None:
    """Remember ``fp8`` as ``source``'s cast for the next layers of this forward (DELAYED:
    those whose casts are keyed on the scale buffer ``scale``; ``amax``: the amax the cast
    recorded, which they record too). Entries of an older version or another region of the
    same tensor are dropped."""
    if source is None or not shareable(cast, scale):
        return
    key = _key(cast, reduce_dim, config, dtype, scale)
    _entry(source, create=True)[key] = (fp8, scale, amax, cast, config)


def delayed_owner(
    source: torch.Tensor,
    cast: CastConfig,
    config: Float8LinearConfig,
    dtype: torch.dtype,
    module: torch.nn.Module,
) -> torch.nn.Module | None:
    """The layer (not ``module``) that first cast ``source`` with this DELAYED input cast in
    this forward (same version, same checkpoint region), or None: then ``module`` is that
    first layer, and later ones get it here. What ``state.tie_input`` ties to."""
    entry = _entry(source, create=True)
    key = ("owner", cast, config, dtype)
    ref = entry.get(key)
    owner = None if ref is None else ref()
    if owner is None:
        entry[key] = weakref.ref(module)
    return None if owner is module else owner
