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

Tied input state (``tie_input``, ``Tie``): layers that read the same tensor (q/k/v, gate/up)
with bitwise-equal DELAYED input state are tied, so that they share one float8 cast of that
tensor (float8kit/shared_cast.py). A tie is host-side bookkeeping only: every layer keeps its
own buffers (no tensor is shared between state_dict keys, so safetensors and
``save_pretrained`` take them) and records its own amaxes, so its state is exactly what it
would be alone, whatever the tied layers read; the tie only says which casts may be shared.
A load or a reset unties the layer; the next forward ties it again where the states are equal.
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


def stateful_casts(config: Float8LinearConfig, kind: ScalingType | None = None):
    """``(role, cast)`` of every operand of ``config`` that keeps DELAYED/STATIC state (only
    ``kind``'s, if given), in ``GEMM_ROLES``' order."""
    for role in GEMM_ROLES:
        cast = config.stateful_cast(role)
        if cast is not None and kind in (None, cast.scaling_type):
            yield role, cast


def buffer_names(config: Float8LinearConfig) -> list[str]:
    """The float8 state buffers a layer with ``config`` has, in registration order."""
    names = []
    for role, cast in stateful_casts(config):
        if cast.scaling_type is ScalingType.DELAYED:
            names += [history_name(role), amax_name(role)]
        names.append(scale_name(role))
    return names


def has_delayed(config: Float8LinearConfig) -> bool:
    """Whether any operand of a layer with ``config`` is DELAYED."""
    return any(stateful_casts(config, ScalingType.DELAYED))


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
      Neither is copied or pickled with the layer (a copy starts untied).
    - ``forward_count``: a CPU int64 tensor, never moved (``count_delayed_forward``): the
      recording forwards since the last ``precompute_scales``.
    - ``uncalibrated``: operands whose STATIC scale is not set; ``calibration_amax``: the
      input amax ``calibrate`` records meanwhile.
    - ``all_gather_scale`` (a ``fsdp.PrecomputedScale``), ``shard_mesh`` (FSDP2's) and
      ``last_all_gather`` (the weight's last FSDP2 all-gather, a ``fsdp.AllGather``).
    """

    def __init__(self, config: Float8LinearConfig):
        self.scales_set: tuple[str, ...] = ()
        self.tie: Tie | None = None
        self.tie_refused = self.calibration_amax = self.all_gather_scale = None
        self.shard_mesh = self.last_all_gather = None
        self.forward_count = torch.zeros((), dtype=torch.int64, device="cpu")
        self.uncalibrated = needs_calibration(config)

    def __getstate__(self) -> dict:
        # a tie holds weak references to the tied layers (not picklable, and a copy's tie
        # would name the original's layers): a copy or a loaded pickle starts untied; the
        # FSDP2 all-gather state names the original's parameter, shard and process group
        dropped = ("tie", "tie_refused", "all_gather_scale", "last_all_gather")
        return {**self.__dict__, **dict.fromkeys(dropped)}

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


class _Member:
    """What a ``Tie`` knows of one of its layers: the layer and its input scale buffer (weakly),
    that buffer's version when the tie last knew it equal to the others', the reads it
    recorded since (one id per tensor, ``shared_cast.read_id``) and how many recording
    forwards those account for."""

    def __init__(self, layer: nn.Module, reads: set[int], seen: int):
        self.layer = weakref.ref(layer)
        scale = layer._buffers[scale_name(GemmRole.INPUT)]
        self.scale, self.version = weakref.ref(scale), scale._version
        self.reads, self.seen = reads, seen


class Tie:
    """Layers whose DELAYED input scales the host knows to be bitwise equal, so that one float8
    cast of a tensor they all read serves each of them (``shared_cast``); host-side only.

    Every layer keeps and updates its own buffers, exactly as alone: a layer that reuses
    another's cast records the amax that cast recorded (``linear._Float8Matmul``). So a tie
    never changes a value, it only decides which casts may be shared, and it must only
    claim what holds. Equal scales stay equal until ``precompute_scales`` writes them:
    ``settle`` then keeps together only the layers whose amax records are equal by
    construction, those that recorded the same set of tensors since the last update
    (``note``), every one of their recording forwards accounted for (against
    ``LayerState.forward_count``: a compiled, tensor-subclass or other untracked forward
    leaves its layer out). A scale buffer written by anything else (a new buffer or a new
    version) ends that layer's sharing too (``holds``). No device value is read for any of it.
    """

    def __init__(self):
        self.members: dict[int, _Member] = {}

    def add(self, layer: nn.Module, like: nn.Module | None = None) -> None:
        """Add ``layer``, known equal to ``like`` (a member) now, reads included; or, without
        ``like``, the first member: its recording forwards so far are where the tie starts."""
        reads = set() if like is None else set(self.members[id(like)].reads)
        self.members[id(layer)] = _Member(layer, reads, int(layer.fp8_state.forward_count))
        layer.fp8_state.tie = self

    def remove(self, layer: nn.Module) -> None:
        self.members.pop(id(layer), None)
        live = self.live()
        if len(live) == 1:  # a tie of one is no tie
            live[0].fp8_state.tie = None
            self.members.clear()

    def live(self) -> list[nn.Module]:
        return [m for member in self.members.values() if (m := member.layer()) is not None]

    def holds(self, layer: nn.Module) -> bool:
        """Whether ``layer`` is a member whose scale buffer is the one the tie knows equal
        (same tensor, not written since)."""
        member = self.members.get(id(layer))
        if member is None or member.layer() is not layer:
            return False
        scale = layer._buffers[scale_name(GemmRole.INPUT)]
        return member.scale() is scale and scale._version == member.version

    def note(self, layer: nn.Module, read: int | None) -> None:
        """``layer`` ran a recording forward that read the tensor ``read`` (None: an empty
        input, which records nothing)."""
        member = self.members[id(layer)]
        if read is not None:
            member.reads.add(read)
        member.seen += 1

    def settle(self, updated: set[int]) -> None:
        """After ``precompute_scales`` wrote the scales of the layers whose ids are in
        ``updated``: split this tie into the groups still known equal (see the class)."""
        groups: dict[tuple, list[tuple[nn.Module, _Member]]] = {}
        for lid, member in self.members.items():
            layer = member.layer()
            if layer is None:
                continue
            tracked = member.seen == int(layer.fp8_state.forward_count)
            key = (lid in updated, frozenset(member.reads)) if tracked else (lid,)
            groups.setdefault(key, []).append((layer, member))
        self.members.clear()
        for key, rows in groups.items():
            for layer, _ in rows:
                layer.fp8_state.tie = None
            if len(rows) < 2:
                continue
            tie = Tie()
            for layer, member in rows:
                if key[0]:  # updated: equal new scales, records cleared, counts zeroed
                    member = _Member(layer, set(), 0)
                tie.members[id(layer)] = member
                layer.fp8_state.tie = tie


def settle_ties(layers: list[nn.Module]) -> None:
    """Called by ``precompute_scales`` right after it wrote the DELAYED scales of ``layers``
    (the tied ones among them), before it zeroes their forward counts."""
    ties = {id(t): t for m in layers if (t := m.fp8_state.tie) is not None}
    updated = {id(m) for m in layers}
    for tie in ties.values():
        tie.settle(updated)


@torch.no_grad()
def tie_input(module: nn.Module, owner: nn.Module, hp: torch.Tensor, record: bool) -> bool:
    """Tie ``module``'s DELAYED input state to ``owner``'s (``Tie``) if it equals the state
    ``owner`` had before it cast ``hp`` in this forward, which ``module`` is about to cast with
    the same cast; otherwise leave both alone. True if ``module`` was tied now.

    Equal means bitwise: the same amax history and scale, and the amax record ``module``
    would have after recording ``hp``'s amax (train mode, ``record``) equal to ``owner``'s now
    (or, not recording, equal records). Then ``owner``'s cast of ``hp`` is bitwise the one
    ``module`` would make, and so are later ones while the tie holds (``Tie``): the tie is
    how fan-out layers share one DELAYED cast. One host read per comparison: at the first
    forward of a pair, and again after a scale update or load only while it differs.
    """
    own, theirs = module.fp8_state, owner.fp8_state
    for layer in (module, owner):  # a scale written since the tie knew it: that layer leaves
        tie = layer.fp8_state.tie
        if tie is not None and not tie.holds(layer):
            untie_input(layer)
    if own.tie is not None:
        return False  # tied to it, or to other layers
    names = [f(GemmRole.INPUT) for f in (history_name, amax_name, scale_name)]
    mine = [module._buffers[n] for n in names]
    theirs_buffers = [owner._buffers[n] for n in names]
    if any(isinstance(t, DTensor) for t in (*mine, *theirs_buffers)):
        return False  # tensor parallel: replicated state, not tied
    scale = theirs_buffers[2]
    memo = (weakref.ref(scale), scale._version, mine[2]._version)
    refused = own.tie_refused
    if refused is not None and refused[0]() is scale and refused[1:] == memo[1:]:
        return False
    # Out of sight of dispatch modes: a selective-checkpoint region replays the ops it saw in
    # the first forward, and its recomputation (already tied) makes no comparison.
    with _disable_current_modes():
        amax = mine[1]
        if record:
            amax = amax.clamp(min=scaling.recorded_amax(hp).float())
        equal = (
            torch.equal(mine[0], theirs_buffers[0])
            and torch.equal(mine[2], theirs_buffers[2])
            and torch.equal(amax, theirs_buffers[1])
        )
    if not equal:
        own.tie_refused = memo
        return False
    if theirs.tie is None:
        Tie().add(owner)
    theirs.tie.add(module, like=owner)
    own.tie_refused = None
    return True


def shares_input(module: nn.Module, owner: nn.Module) -> bool:
    """Whether ``module`` may use ``owner``'s cast of a tensor both read: tied, and both scale
    buffers still the ones the tie knows equal."""
    tie = module.fp8_state.tie
    return tie is not None and owner.fp8_state.tie is tie and tie.holds(module) and tie.holds(owner)


def untie_input(module: nn.Module) -> None:
    """Take ``module`` out of its tie (its buffers are its own anyway)."""
    own = module.__dict__.get("fp8_state")
    tie = None if own is None else own.tie
    if tie is not None:
        own.tie = None
        tie.remove(module)


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
    for role, cast in stateful_casts(config):
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
    static = stateful_casts(config, ScalingType.STATIC)
    return tuple(OPERAND_NAMES[role] for role, cast in static if cast.static_scale is None)


@torch.no_grad()
def reset_state(module: nn.Module, config: Float8LinearConfig, names: list[str]) -> None:
    """Fill the float8 buffers ``names`` of ``module`` with their initial values (a tied
    layer is untied first: the layers it shares state with keep theirs)."""
    untie_input(module)
    own = module.fp8_state
    own.scales_set = ()
    for role, cast in stateful_casts(config):
        for name in (history_name(role), amax_name(role)):
            if name in names:
                module._buffers[name].fill_(UNSET)
        if scale_name(role) in names:
            module._buffers[scale_name(role)].fill_(_initial_scale(cast))
    reset = {n.removeprefix("fp8_scale_") for n in names}
    own.uncalibrated = tuple(
        op for op in needs_calibration(config) if op in own.uncalibrated or op in reset
    )


_ALL_STATE_NAMES = frozenset(
    f(role) for role in GEMM_ROLES for f in (history_name, amax_name, scale_name)
)


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
        and key[len(prefix) :] in _ALL_STATE_NAMES - own
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
    for role, _ in stateful_casts(config, ScalingType.STATIC):
        name = scale_name(role)
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
    out = collections.OrderedDict(
        (k, v) for k, v in state_dict.items() if k.rsplit(".", 1)[-1] not in _ALL_STATE_NAMES
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
        self.state_dict = {
            key: value
            for key, value in self.state_dict.items()
            if key in present or key.rsplit(".", 1)[-1] not in _ALL_STATE_NAMES
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


# A custom op, so the counting runs on the host at every call even inside a compiled graph
# (dynamo would otherwise trace a Python counter once and guard on its value, recompiling
# every step). It mutates only a CPU tensor: no device sync. Not a buffer, so compiled
# graphs take it as an input and precompute_scales resets it in place.
@torch.library.custom_op("float8kit::count_delayed_forward", mutates_args=("count",))
def count_delayed_forward(count: torch.Tensor, warn_after: int) -> None:
    """Add one to a layer's forward count; warn when it first exceeds ``warn_after`` (> 0)."""
    count += 1
    if warn_after and int(count) == warn_after + 1:
        warnings.warn(
            f"float8kit: a Float8Linear with DELAYED scaling ran {warn_after + 1} train-mode "
            "forwards without float8kit.precompute_scales(model): its scales are stale "
            "(recorded amaxes reach the amax history only through precompute_scales). Call "
            "precompute_scales(model) after every optimizer.step(), or raise "
            "Float8LinearConfig.stale_delayed_warn_after if you accumulate gradients over "
            "more micro-batches.",
            UserWarning,
            stacklevel=2,
        )


@count_delayed_forward.register_fake
def _(count: torch.Tensor, warn_after: int) -> None:
    return None
