"""Per-layer scale state of DELAYED and STATIC operands: buffer names, creation, reset,
checkpoint loading, and the stale-scale check.

For each operand ``op`` in ``input``, ``weight``, ``grad_output`` whose scaling is DELAYED or
STATIC, a ``Float8Linear`` holds persistent fp32 buffers on the weight's device (in the
state_dict): ``fp8_amax_history_{op}`` (L,) and ``fp8_amax_{op}`` () for DELAYED, and
``fp8_scale_{op}`` () for both; -1 marks an empty slot or an unset scale (docs/scaling.md has
the table; L is ``CastConfig.amax_history_len``). A checkpoint that has none of a layer's
float8 buffers (e.g. one saved from the plain ``nn.Linear`` model) loads with ``strict=True``:
the layer's float8 state is reset to its initial values, as for a fresh layer. The other way,
``strip_float8_state`` drops these buffers from a converted model's state_dict for the plain
model. The buffers stay fp32 through ``model.to(dtype)`` and are reset when they come off
the meta device (``after_apply``).

Tied input state (``tie_input``): layers that read the same tensor (q/k/v, gate/up) and hold
bitwise-equal DELAYED input state share one set of input buffers from then on, so that they
can share one float8 cast of that tensor (float8kit/shared_cast.py). Each layer still has its
own state_dict entries (same values); ``precompute_scales`` updates a shared buffer once. A
load or a reset first unties the layer (its own copies), so that it takes the values it is
given; the next forward ties it again where the states are still equal.
"""

from __future__ import annotations

import collections
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _disable_current_modes

from float8kit import scaling
from float8kit.config import GEMM_ROLES, CastConfig, Float8LinearConfig, GemmRole, ScalingType
from float8kit.scaling import UNSET

# What precompute_scales gathers from each kind of scale state: a 1-D fp32 tensor of the
# amaxes this rank saw, and a function that writes the scales from the same amaxes reduced
# (max) over all ranks (see float8kit.precompute).
Contribution = tuple[torch.Tensor, Callable[[torch.Tensor], None]]

OPERAND_NAMES = {
    GemmRole.INPUT: "input",
    GemmRole.WEIGHT: "weight",
    GemmRole.GRAD_OUTPUT: "grad_output",
}


def history_name(role: GemmRole) -> str:
    return f"fp8_amax_history_{OPERAND_NAMES[role]}"


def amax_name(role: GemmRole) -> str:
    return f"fp8_amax_{OPERAND_NAMES[role]}"


def scale_name(role: GemmRole) -> str:
    return f"fp8_scale_{OPERAND_NAMES[role]}"


def buffer_names(config: Float8LinearConfig) -> list[str]:
    """The float8 state buffers a layer with ``config`` has, in registration order."""
    names = []
    for role in GEMM_ROLES:
        cast = config.stateful_cast(role)
        if cast is None:
            continue
        if cast.scaling_type is ScalingType.DELAYED:
            names += [history_name(role), amax_name(role)]
        names.append(scale_name(role))
    return names


def has_delayed(config: Float8LinearConfig) -> bool:
    """Whether any operand of a layer with ``config`` is DELAYED."""
    # a loop, not a generator with := (torch 2.11's dynamo cannot read that cell when
    # tracing the forward, which calls this)
    for role in GEMM_ROLES:
        cast = config.stateful_cast(role)
        if cast is not None and cast.scaling_type is ScalingType.DELAYED:
            return True
    return False


def _initial_scale(cast: CastConfig) -> float:
    if cast.scaling_type is ScalingType.STATIC and cast.static_scale is not None:
        return cast.static_scale
    return UNSET


class LayerState:
    """The host-side float8 state of one Float8Linear (``layer.fp8_state``, made by
    ``init_state``; not in the state_dict, copied with the layer), beside its buffers:

    - ``scales_set``: operands whose DELAYED scale the host knows is set, marked by
      ``precompute_scales`` without a host sync; casts then use the scale buffer as is (no
      first-step amax pass; the FSDP2 all-gather needs no all-reduce). A tuple read in
      forward, so compiled graphs specialize on it. Cleared by init, reset and load.
    - ``tie`` (``Tie``) and ``tie_refused`` (the last comparison that found the states
      unequal: the owner's scale buffer, its version, this scale's version): ``tie_input``.
    - ``forward_count``: a CPU int64 tensor, never moved (``count_delayed_forward``).
    - ``uncalibrated``: operands whose STATIC scale is not set; ``calibration_amax``: the
      input amax ``calibrate`` records meanwhile.
    - ``all_gather_scale`` (a ``fsdp.PrecomputedScale``) and ``shard_mesh`` (FSDP2's).
    """

    def __init__(self, config: Float8LinearConfig):
        self.scales_set: tuple[str, ...] = ()
        self.tie: Tie | None = None
        self.tie_refused = self.calibration_amax = self.all_gather_scale = self.shard_mesh = None
        self.forward_count = torch.zeros((), dtype=torch.int64, device="cpu")
        self.uncalibrated = needs_calibration(config)

    def mark_scales_set(self, operand: str) -> None:
        if operand not in self.scales_set:
            self.scales_set = (*self.scales_set, operand)

    def operand(
        self, module: nn.Module, role: GemmRole, record: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
        """(``fp8_scale_<op>``, ``fp8_amax_<op>`` if DELAYED and ``record``, whether it is in
        ``scales_set``) of this state's ``module``: ``operand_scale``'s state arguments.
        (None, None, False) if the operand keeps no state."""
        cast = module.config.stateful_cast(role)
        if cast is None:
            return None, None, False
        scale = module._buffers[scale_name(role)]
        if cast.scaling_type is not ScalingType.DELAYED:
            return scale, None, False
        amax_record = module._buffers[amax_name(role)] if record else None
        return scale, amax_record, OPERAND_NAMES[role] in self.scales_set


class Tie:
    """The layers that share one input state, and which of them read the current tensor.

    A tie stays right while its layers keep reading one tensor: each tensor (a "round") is
    read by all of them before the next one. A layer that reads another tensor while the
    current one is still alive and not read by every layer breaks that: it would record its
    amax into the others' state. ``read`` then unties that layer and warns."""

    def __init__(self, *layers: nn.Module):
        self.layers = [weakref.ref(m) for m in layers]
        self.source, self.state, self.readers = None, None, set()

    def read(self, layer: nn.Module, source: torch.Tensor, state: tuple) -> bool:
        """Note that ``layer`` reads ``source`` (in ``state``: version, checkpoint region);
        False (and ``layer`` untied, with a warning) where that breaks the tie."""
        current = None if self.source is None else self.source()
        if current is source and state == self.state:
            self.readers.add(id(layer))
            return True
        live = {id(m) for ref in self.layers if (m := ref()) is not None}
        if current is not None and not live <= self.readers:
            warnings.warn(
                f"float8kit: a Float8Linear({layer.in_features}, {layer.out_features}) whose "
                "DELAYED input state was tied to other layers' (they read one tensor at "
                "its first forward) now reads another tensor: untied from here on; amaxes "
                "recorded this step may include the other layers' input",
                UserWarning,
                stacklevel=3,
            )
            untie_input(layer)
            return False
        self.source, self.state, self.readers = weakref.ref(source), state, {id(layer)}
        return True


def _input_names() -> list[str]:
    role = GemmRole.INPUT
    return [history_name(role), amax_name(role), scale_name(role)]


@torch.no_grad()
def tie_input(module: nn.Module, owner: nn.Module, hp: torch.Tensor, record: bool) -> None:
    """Make ``module``'s DELAYED input state ``owner``'s (the same buffers) if it equals the
    state ``owner`` had before it cast ``hp`` in this forward, which ``module`` is about to
    cast with the same cast; otherwise leave both alone.

    Equal means bitwise: the same amax history and scale, and the amax record ``module``
    would have after recording ``hp``'s amax (train mode, ``record``) equal to ``owner``'s now
    (or, not recording, equal records). Then ``module``'s cast of ``hp`` and every later step
    are bitwise what ``owner``'s state gives, as long as both keep reading one tensor: the
    tie is how fan-out layers share one DELAYED cast. One host read per comparison: at the
    first forward of a pair, and again after a scale update or load only while it differs.
    """
    names, own = _input_names(), module.fp8_state
    mine = [module._buffers[n] for n in names]
    theirs = [owner._buffers[n] for n in names]
    if mine[2] is theirs[2] or own.tie is not None:
        return  # tied to it, or to other layers
    if any(isinstance(t, DTensor) for t in (*mine, *theirs)):
        return  # tensor parallel: replicated state, not tied
    memo = (weakref.ref(theirs[2]), theirs[2]._version, mine[2]._version)
    refused = own.tie_refused
    if refused is not None and refused[0]() is theirs[2] and refused[1:] == memo[1:]:
        return
    # Out of sight of dispatch modes: a selective-checkpoint region replays the ops it saw in
    # the first forward, and its recomputation (already tied) makes no comparison.
    with _disable_current_modes():
        amax = mine[1]
        if record:
            amax = amax.clamp(min=scaling.recorded_amax(hp).float())
        equal = (
            torch.equal(mine[0], theirs[0])
            and torch.equal(mine[2], theirs[2])
            and torch.equal(amax, theirs[1])
        )
    if not equal:
        own.tie_refused = memo
        return
    for name, buf in zip(names, theirs, strict=True):
        module._buffers[name] = buf
    theirs = owner.fp8_state
    if theirs.tie is None:
        theirs.tie = Tie(owner)
    theirs.tie.layers.append(weakref.ref(module))
    own.tie, own.tie_refused = theirs.tie, None
    # one scale buffer: set for both where the host knew it set for either
    op = OPERAND_NAMES[GemmRole.INPUT]
    for a, b in ((own, theirs), (theirs, own)):
        if op in b.scales_set:
            a.mark_scales_set(op)


def untie_input(module: nn.Module) -> None:
    """Give a tied layer its own copies of its input state buffers (same values)."""
    own = module.__dict__.get("fp8_state")
    tie = None if own is None else own.tie
    if tie is not None:
        own.tie = None
        tie.layers = [ref for ref in tie.layers if ref() not in (None, module)]
        for name in _input_names():
            module._buffers[name] = module._buffers[name].clone()


def init_state(module: nn.Module, config: Float8LinearConfig) -> None:
    """(Re)create ``module``'s float8 state buffers for ``config`` on its weight's device,
    with their initial values. Buffers of a previous config that ``config`` lacks go away.

    Also gives it a new host-side ``LayerState`` (``module.fp8_state``).
    """
    untie_input(module)
    keep = set(buffer_names(config))
    for name in [n for n in module._buffers if n.startswith("fp8_") and n not in keep]:
        del module._buffers[name]
    device = module.weight.device
    # fp32 whatever the default dtype (a model built under torch.set_default_dtype(bf16), as
    # torchtitan builds its models, would otherwise get bf16 scales)
    fp32 = torch.float32
    for role in GEMM_ROLES:
        cast = config.stateful_cast(role)
        if cast is None:
            continue
        if cast.scaling_type is ScalingType.DELAYED:
            history = torch.full((cast.amax_history_len,), UNSET, dtype=fp32, device=device)
            module.register_buffer(history_name(role), history)
            module.register_buffer(
                amax_name(role), torch.full((), UNSET, dtype=fp32, device=device)
            )
        scale = torch.full((), _initial_scale(cast), dtype=fp32, device=device)
        module.register_buffer(scale_name(role), scale)
    module.fp8_state = LayerState(config)


def needs_calibration(config: Float8LinearConfig) -> tuple[str, ...]:
    """Operands that are STATIC with no ``static_scale``: ``calibrate`` must set them."""
    names = []
    for role in GEMM_ROLES:
        cast = config.stateful_cast(role)
        if (
            cast is not None
            and cast.scaling_type is ScalingType.STATIC
            and cast.static_scale is None
        ):
            names.append(OPERAND_NAMES[role])
    return tuple(names)


@torch.no_grad()
def reset_state(module: nn.Module, config: Float8LinearConfig, names: list[str]) -> None:
    """Fill the float8 buffers ``names`` of ``module`` with their initial values (a tied
    layer is untied first: the layers it shares state with keep theirs)."""
    untie_input(module)
    own = module.fp8_state
    own.scales_set = ()
    for role in GEMM_ROLES:
        cast = config.stateful_cast(role)
        if cast is None:
            continue
        for name in (history_name(role), amax_name(role)):
            if name in names:
                module._buffers[name].fill_(UNSET)
        if scale_name(role) in names:
            module._buffers[scale_name(role)].fill_(_initial_scale(cast))
    reset = {n.removeprefix("fp8_scale_") for n in names}
    own.uncalibrated = tuple(
        op for op in needs_calibration(config) if op in own.uncalibrated or op in reset
    )


def _all_state_names() -> set[str]:
    return {f(role) for role in GEMM_ROLES for f in (history_name, amax_name, scale_name)}


def foreign_state_hint(
    config: Float8LinearConfig, state_dict: Mapping[str, Any], prefix: str
) -> str | None:
    """The error to add when ``state_dict`` holds float8 scale state under ``prefix`` that
    this layer's recipe does not keep (a DELAYED/STATIC checkpoint loaded into another
    recipe): point at ``strip_float8_state`` instead of a bare "unexpected keys"."""
    own = set(buffer_names(config))
    extra = sorted(
        key
        for key in state_dict
        if key.startswith(prefix)
        and "." not in key[len(prefix) :]
        and key[len(prefix) :] in _all_state_names() - own
    )
    if not extra:
        return None
    return (
        f"{prefix.rstrip('.') or 'the layer'}: the state_dict has float8 scale state "
        f"({', '.join(k[len(prefix) :] for k in extra)}) that this layer's recipe does not keep "
        "(it was saved from a DELAYED/STATIC model): load "
        "float8kit.strip_float8_state(state_dict) to start this recipe's state from scratch"
    )


def after_load(
    module: nn.Module,
    config: Float8LinearConfig,
    state_dict: dict,
    prefix: str,
    missing_keys: list[str],
) -> None:
    """Called after ``nn.Module._load_from_state_dict`` on a Float8Linear.

    A checkpoint with none of the layer's float8 buffers (a plain ``nn.Linear`` checkpoint,
    or one converted with another recipe) resets them to their initial values and does not
    report them missing. One with some but not all of them reports the rest missing (a
    partial float8 state would be inconsistent). A loaded STATIC scale counts as calibrated
    when it is set; a loaded ``UNSET`` one (a checkpoint saved before ``calibrate``) leaves
    the operand uncalibrated, so the forward raises instead of casting with scale -1.
    """
    own = module.fp8_state
    own.scales_set = ()
    names = buffer_names(config)
    absent = [n for n in names if prefix + n not in state_dict]
    if absent and len(absent) == len(names):
        reset_state(module, config, names)
        gone = {prefix + n for n in names}
        missing_keys[:] = [k for k in missing_keys if k not in gone]
    uncalibrated = set(own.uncalibrated)
    for role in GEMM_ROLES:
        cast = config.stateful_cast(role)
        name = scale_name(role)
        if cast is None or cast.scaling_type is not ScalingType.STATIC:
            continue
        if prefix + name not in state_dict or module._buffers[name].is_meta:
            continue
        # One host read per STATIC operand, at load time only.
        if bool(module._buffers[name] >= 0):
            uncalibrated.discard(OPERAND_NAMES[role])
        else:
            uncalibrated.add(OPERAND_NAMES[role])
    own.uncalibrated = tuple(op for op in OPERAND_NAMES.values() if op in uncalibrated)


def strip_float8_state(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` without the float8 scale state of DELAYED/STATIC layers, for the plain
    (unconverted) model.

    A converted model's state_dict holds nn.Linear's keys and values plus, for DELAYED/STATIC
    operands, the buffers in the table above. The plain model's ``load_state_dict(...,
    strict=True)`` refuses those as unexpected keys; this drops them (and nothing else):
    ``plain_model.load_state_dict(float8kit.strip_float8_state(sd))``. The other direction
    needs nothing: a plain checkpoint loads into a converted model (see ``after_load``).

    Args:
        state_dict: a converted model's (or optimizer-free checkpoint's) state_dict.

    Returns:
        A new ordered dict sharing the remaining values (tensors are not copied), with the
        input's ``_metadata`` (module versions) if it has one. The input is not modified.
    """
    names = _all_state_names()
    out = collections.OrderedDict(
        (key, value) for key, value in state_dict.items() if key.rsplit(".", 1)[-1] not in names
    )
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata
    return out


class Float8LoadPlanner(DefaultLoadPlanner):
    """``torch.distributed.checkpoint.load`` planner for checkpoints without float8 state.

    A DELAYED/STATIC model's state_dict has scale-state buffers that a checkpoint of the plain
    model (or of a DYNAMIC recipe) lacks, and DCP's default planner refuses the load
    ("Missing key in checkpoint state_dict: ...fp8_amax_history_input"). With
    ``dcp.load(state_dict, checkpoint_id=path, planner=float8kit.Float8LoadPlanner())``
    those buffers are left out of the load, so they keep their current values: the initial
    ones (as after conversion) for a model that has not trained yet. Every other missing key
    still raises, as with the default planner; a checkpoint that has the float8 state loads it.
    """

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        super().set_up_planner(state_dict, metadata, is_coordinator)
        present = metadata.state_dict_metadata if metadata is not None else {}
        names = _all_state_names()
        self.state_dict = {
            key: value
            for key, value in self.state_dict.items()
            if key in present or key.rsplit(".", 1)[-1] not in names
        }


def after_apply(
    module: nn.Module, config: Float8LinearConfig, before: dict[str, torch.Tensor]
) -> None:
    """Called after ``nn.Module._apply(fn)`` on a Float8Linear, with its float8 buffers as
    they were before (``before``): keeps them fp32 and valid.

    A dtype change (``.to(torch.bfloat16)``, ``.half()``) is undone from the original fp32
    values, keeping the device ``fn`` chose: scale state must stay fp32 (an fp16 scale
    overflows, a bf16 one rounds off the range). A buffer that was on the meta device and is
    now real (``to_empty``) holds uninitialised memory: it is reset to its initial values.
    """
    from_meta = []
    for name, old in before.items():
        new = module._buffers[name]
        if new.dtype != torch.float32:
            if old.is_meta:
                new = torch.empty(old.shape, dtype=torch.float32, device=new.device)
            else:
                new = old.to(device=new.device)
            module._buffers[name] = new
        if old.is_meta and not new.is_meta:
            from_meta.append(name)
    if from_meta:
        reset_state(module, config, from_meta)


# ---------------------------------------------------------------------------- stale scales


def stale_message(count: int) -> str:
    return (
        f"float8kit: a Float8Linear with DELAYED scaling ran {count} train-mode forwards "
        "without float8kit.precompute_scales(model): its scales are stale (recorded amaxes "
        "reach the amax history only through precompute_scales). Call "
        "precompute_scales(model) after every optimizer.step(), or raise "
        "Float8LinearConfig.stale_delayed_warn_after if you accumulate gradients over more "
        "micro-batches."
    )


# A custom op, so the counting runs on the host at every call even inside a compiled graph
# (dynamo would otherwise trace a Python counter once and guard on its value, recompiling
# every step). It mutates only a CPU tensor: no device sync. Not a buffer, so compiled
# graphs take it as an input and precompute_scales resets it in place.
@torch.library.custom_op("float8kit::count_delayed_forward", mutates_args=("count",))
def count_delayed_forward(count: torch.Tensor, warn_after: int) -> None:
    """Add one to a layer's forward count; warn when it first exceeds ``warn_after``."""
    count += 1
    if int(count) == warn_after + 1:
        warnings.warn(stale_message(warn_after + 1), UserWarning, stacklevel=2)


@count_delayed_forward.register_fake
def _(count: torch.Tensor, warn_after: int) -> None:
    return None
