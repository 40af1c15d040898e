"""``Float8Monitor``: per-layer float8 numerics measured during training, the worst layer
named, and an opt-in guardrail that switches a failing layer to hp.

On every ``every``-th forward of the model it is attached to (a *sampled step*), for each
``Float8Linear`` and each of its three gemms, the monitor measures the float8 result the
layer actually produced against the same gemm in fp32 on the same operands:

- ``output``: the layer's output (bias included) vs ``F.linear`` in fp32 on the layer's input
  and weight (a forward hook);
- ``grad_input`` and ``grad_weight``: the gradients the layer's float8 backward returned (a
  hook on its autograd node) vs ``grad_output @ weight`` and ``grad_output.T @ input`` in fp32.

For each cast operand of a gemm it also reports the saturated fraction (elements whose
``|hp * scale|`` exceeds the float8 max and were clamped), the underflow fraction (non-zero hp
elements that became 0) and the scale. These come from recasting the operand with the layer's
own cast (``cast_to_float8`` with the layer's scale state, recording nothing): DELAYED and
STATIC state is read, never changed.

Steps that are not sampled run no extra op: each hook returns after one Python check.

Under FSDP2 (``fully_shard``) every rank measures its own tokens; on a sampled step the
monitor folds every sum it needs (signal and noise powers, clamped/underflowed/non-zero
element counts, scales) into one tensor and runs one ``all_reduce(SUM)``, so every rank
reports the same numbers and takes the same fallback decision.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.eval_frame import DynamoStance, _set_stance

from float8kit import config
from float8kit.cast import cast_to_float8, is_recomputing
from float8kit.config import GemmRole
from float8kit.linear import Float8Linear

GEMMS = tuple(g.name for g in config.GEMMS)

# gemm -> ((operand name, role, cast field, reduce dim) for its two operands)
_OPERANDS = {
    g.name: tuple(
        (op.role.value, op.role, op.cast_field, op.reduce_dim) for op in (g.left, g.right)
    )
    for g in config.GEMMS
}
# per operand: clamped count, element count, underflowed count, non-zero count, scale
_OPERAND_SUMS = 5


class _HpFallback:
    """Mixed in front of a ``Float8Linear``'s class (its own, or the class ``fully_shard``
    made of it) when the monitor switches it to hp: ``nn.Linear``'s forward, same
    parameters, buffers and state_dict keys (the float8 state stays, unused)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight, self.bias)


_HP_CLASSES: dict[type, type] = {}


def _hp_class(cls: type) -> type:
    if cls not in _HP_CLASSES:
        _HP_CLASSES[cls] = type(f"HpFallback{cls.__name__}", (_HpFallback, cls), {})
    return _HP_CLASSES[cls]


class _Monitored:
    """Mixed in front of each monitored ``Float8Linear``'s class while a monitor is attached.

    Invariants: the layer computes exactly what it computed before (same parameters,
    buffers, state_dict keys, numbers). Two things change under ``torch.compile``:

    - the class is part of what dynamo guards on, its hooks are not
      (``torch._dynamo.config.skip_nnmodule_hook_guards``): without the new class, a graph
      compiled for another model of the same architecture (or for this one before the
      monitor came) would run this layer with the monitor's hooks skipped, measuring nothing;
    - on a sampled step (``_monitor_eager``, set by the monitor for that forward) the layer's
      forward runs eagerly, also inside a compiled graph (a graph break around each layer on
      sampled steps only), so that the monitor sees the layer's own float8 gemm and its
      autograd node whichever way the model was compiled.
    """

    _monitor_eager = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self._monitor_eager:
            return _eager_forward(self, input)
        return super().forward(input)


@torch._dynamo.disable
def _eager_forward(mod: _Monitored, input: torch.Tensor) -> torch.Tensor:
    return super(_Monitored, mod).forward(input)


_MONITORED_CLASSES: dict[type, type] = {}


def _monitored_class(cls: type) -> type:
    if cls not in _MONITORED_CLASSES:
        _MONITORED_CLASSES[cls] = type(f"Monitored{cls.__name__}", (_Monitored, cls), {})
    return _MONITORED_CLASSES[cls]


def _unmonitored_class(cls: type) -> type:
    """``cls`` without the monitor's mixin (an hp fallback stays one)."""
    for base, monitored in _MONITORED_CLASSES.items():
        if cls is monitored:
            return base
        if cls is _HP_CLASSES.get(monitored):
            return _hp_class(base)
    return cls


def _operand_sums(
    mod: Float8Linear, hp: torch.Tensor, field: str, role: GemmRole, reduce_dim: int
) -> torch.Tensor:
    """[clamped, numel, underflowed, non-zero, scale] of ``hp`` cast as ``mod`` casts it for
    one gemm (``scale``: the tensorwise scale, or the smallest of axiswise/blockwise ones).
    Zeros when that gemm runs in hp. No side effect on ``mod``'s state."""
    c = mod.config
    cast = getattr(c, field)
    if not cast.enabled or isinstance(mod, _HpFallback):
        return hp.new_zeros(_OPERAND_SUMS, dtype=torch.float64)
    state_scale, _, scale_set = mod.fp8_state.operand(mod, role, record=False)
    # a stochastically rounded cast draws random bits: from a fork of torch's generators, so
    # that monitoring leaves the training run's random stream as it was
    devices = [hp.device] if hp.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=cast.option("stochastic_rounding")):
        fp8 = cast_to_float8(hp, cast, role, reduce_dim, c, state_scale, None, scale_set)
    gran, data = fp8._gran, fp8._data
    scale = gran.multiplier(fp8._scale, data.shape)
    rounded = gran.cast_input(hp)  # (the transformed values, for a Hadamard NVFP4 cast)
    scaled = rounded.to(torch.float32) * scale
    # above the max by more than fp32 rounding: a DYNAMIC scale maps the amax element to
    # fp8_max up to one ulp of the product, which is not a saturation
    clamped = (scaled.abs() > gran.element_max(data) * (1 + 2**-20)).sum()
    nonzero = rounded != 0
    underflow = (nonzero & (gran.elements(data) == 0)).sum()
    return torch.stack(
        [
            clamped.double(),
            torch.tensor(float(hp.numel()), dtype=torch.float64, device=hp.device),
            underflow.double(),
            nonzero.sum().double(),
            scale.amin().double(),
        ]
    )


def _gemm_sums(mod: Float8Linear, gemm: str, ref, actual, left, right) -> list[torch.Tensor]:
    """A gemm's pending sums: its ``_power_sums``, then each operand's ``_operand_sums`` (as
    ``mod`` casts it for this gemm), in ``_OPERANDS`` order, which ``_row`` reads."""
    return [_power_sums(ref, actual)] + [
        _operand_sums(mod, t, field, role, reduce_dim)
        for t, (_, role, field, reduce_dim) in zip((left, right), _OPERANDS[gemm], strict=True)
    ]


def _power_sums(ref: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """[signal power, noise power] of ``actual`` against ``ref`` (fp64)."""
    ref = ref.detach().double()
    return torch.stack([ref.square().sum(), (ref - actual.detach().double()).square().sum()])


def _matmul_node(output: torch.Tensor):
    """The autograd node of the layer's float8 gemm (``_Float8Matmul``), within the few
    view/add nodes between it and the layer's output; None if not found (no grad)."""
    frontier = [output.grad_fn]
    for _ in range(4):
        nxt = []
        for node in frontier:
            if node is None:
                continue
            if type(node).__name__ == "_Float8MatmulBackward":
                return node
            nxt.extend(n for n, _ in node.next_functions)
        frontier = nxt
    return None


def _layer_input(x: torch.Tensor) -> torch.Tensor:
    # what Float8Linear.forward feeds its gemm: the autocast dtype under autocast
    if torch.is_autocast_enabled(x.device.type) and x.is_floating_point():
        x = x.to(torch.get_autocast_dtype(x.device.type))
    return x.reshape(-1, x.shape[-1])


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _sqnr_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)``: inf for an exact result, -inf for a zero reference (or
    an infinite error), NaN where a power is NaN (a NaN or inf operand) or both are inf."""
    if math.isnan(signal) or math.isnan(noise) or (math.isinf(signal) and math.isinf(noise)):
        return math.nan
    if noise == 0:
        return math.inf
    ratio = signal / noise
    return -math.inf if ratio == 0 else 10 * math.log10(ratio)


def _worst_first(row: dict) -> tuple[bool, float]:
    # NaN compares false with everything: sorted by the dB alone it lands anywhere
    db = row["sqnr_db"]
    return (not math.isnan(db), db)


class Float8Monitor:
    """Measure each ``Float8Linear``'s float8 error on sampled steps; optionally switch a
    layer whose output falls below ``fallback_below_db`` to hp.

    Args:
        model: a converted model (``convert_to_float8_training``): the module you call,
            i.e. the ``fully_shard``-ed root; under ``torch.compile`` the module
            ``torch.compile`` returned or the model inside it (sampled steps run each layer
            eagerly either way).
            The monitor counts its train-mode forwards as steps (eval forwards are neither
            counted nor measured); ``monitor.step`` is the last one's number (-1 before the
            first; set it to continue a resumed run's numbering).
        every: measure on the steps that are multiples of ``every`` (0, every, 2 * every...).
        fallback_below_db: a layer whose SQNR falls below this (or is NaN) on a sampled step
            runs in hp from the next step on (once; a warning names the layer, the dB and the
            step). None: measure only.
        fallback_on: ``"output"`` (the output gemm decides) or ``"any"`` (any of the three).
        log_path: append every sampled step's rows to this file as JSON lines (on rank 0
            under torch.distributed); a non-finite dB (inf: an exact result; NaN) is written
            as null.
        group: the process group to reduce over (default: the world, when initialized).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        every: int = 100,
        fallback_below_db: float | None = None,
        fallback_on: str = "output",
        log_path: str | Path | None = None,
        group: dist.ProcessGroup | None = None,
    ):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Float8Monitor: every={every!r} must be an int >= 1 (steps)")
        if fallback_on not in ("output", "any"):
            raise ValueError(
                f"Float8Monitor: fallback_on={fallback_on!r} is not valid: use 'output' or 'any'"
            )
        if fallback_below_db is not None and (
            isinstance(fallback_below_db, bool)
            or not isinstance(fallback_below_db, (int, float))
            or not math.isfinite(fallback_below_db)
        ):
            raise ValueError(
                f"Float8Monitor: fallback_below_db={fallback_below_db!r} must be a finite "
                "number (dB) or None"
            )
        self.model = model
        self.every = every
        self.fallback_below_db = fallback_below_db
        self.fallback_on = fallback_on
        self.log_path = None if log_path is None else Path(log_path)
        self.group = group
        self.step = -1  # the step the last forward belonged to
        self.fallbacks: list[dict] = []
        self.history: list[dict] = []
        self._sampling = False
        self._prior_stance: DynamoStance | None = None
        self._pending: dict[tuple[str, str], list[torch.Tensor]] = {}
        self._backward_pending = False  # a sampled layer's backward will add rows
        self._callback_queued = False  # the step's end-of-backward callback is queued
        self._layers: dict[str, Float8Linear] = {}
        for fqn, mod in model.named_modules():
            if isinstance(mod, Float8Linear):
                fqn = fqn.replace("_orig_mod.", "")
                if mod.config.enable_fsdp_float8_all_gather:
                    raise ValueError(
                        f"Float8Monitor: layer {fqn!r} has enable_fsdp_float8_all_gather=True, "
                        "so its forward sees only the float8 weight and there is no hp weight "
                        "to measure against; monitor a run with "
                        "enable_fsdp_float8_all_gather=False"
                    )
                self._layers[fqn] = mod
        if not self._layers:
            raise ValueError(
                "Float8Monitor: the model has no Float8Linear; convert it with "
                "float8kit.convert_to_float8_training first"
            )
        self._swapped: list[str] = []  # the layers whose class this monitor changed
        for fqn, mod in self._layers.items():
            if not isinstance(mod, _Monitored):
                mod.__class__ = _monitored_class(type(mod))
                self._swapped.append(fqn)
        self._handles = [model.register_forward_pre_hook(self._on_model_forward)]
        self._handles.append(model.register_forward_hook(self._on_model_output))
        for fqn, mod in self._layers.items():
            # first among the layer's forward hooks: before fully_shard's post-forward
            # reshards the weight, whenever fully_shard was applied
            hook = mod.register_forward_hook(self._forward_hook(fqn, mod), prepend=True)
            self._handles.append(hook)

    # ------------------------------------------------------------------ public

    def report(self, all_steps: bool = False) -> list[dict]:
        """Rows of the last sampled step (``all_steps``: of every sampled step so far), one
        per layer and gemm: ``layer``, ``gemm``, ``sqnr_db``, ``saturated``, ``underflow``,
        ``step``, ``fallback`` and ``operands`` ({name: {saturated, underflow, scale}})."""
        self._finalize()
        if all_steps or not self.history:
            return list(self.history)
        last = self.history[-1]["step"]
        return [r for r in self.history if r["step"] == last]

    def worst(self, k: int = 1, gemm: str | None = None) -> list[dict]:
        """The ``k`` rows of the last sampled step with the lowest SQNR (of ``gemm`` only,
        when given); a NaN SQNR (a NaN or inf in the layer's result) ranks lowest of all."""
        rows = [r for r in self.report() if gemm is None or r["gemm"] == gemm]
        return sorted(rows, key=_worst_first)[:k]

    def state_dict(self) -> dict:
        """What to save next to the model's checkpoint so that a resumed run keeps the
        layers switched to hp: the fallbacks and the step count."""
        return {"step": self.step, "fallbacks": [dict(f) for f in self.fallbacks]}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``: switches the same layers to hp again."""
        self.step = int(state["step"])
        for entry in state["fallbacks"]:
            layer = entry["layer"]
            if layer not in self._layers:
                raise KeyError(
                    f"Float8Monitor.load_state_dict: fallback layer {layer!r} is not a "
                    f"Float8Linear of this model (layers: {', '.join(self._layers)})"
                )
            self._switch_to_hp(layer)
            if entry not in self.fallbacks:
                self.fallbacks.append(dict(entry))

    def remove(self) -> None:
        """Detach the monitor's hooks (layers already switched to hp stay switched)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._restore_stance()
        self._set_eager(False)
        for fqn in self._swapped:
            mod = self._layers[fqn]
            mod.__class__ = _unmonitored_class(type(mod))
        self._swapped.clear()

    # ------------------------------------------------------------------ hooks

    # The model-level hooks never run compiled (torch._dynamo.disable): under torch.compile
    # a sampled step runs eagerly (the "force_eager" stance, set here and restored after the
    # forward), so that the hooks see each layer's own float8 gemm and its autograd node; an
    # unsampled step runs the compiled graphs, where the layer hooks trace to nothing. The
    # stance only acts on a compiled module entered after it is set: when the monitor's model
    # runs inside a compiled frame (attached before torch.compile, or called from a compiled
    # function), each layer's forward runs eagerly on a sampled step instead (_Monitored).

    @torch._dynamo.disable
    def _on_model_forward(self, module, args) -> None:
        self._restore_stance()
        if self._pending:  # a sampled step with no backward (eval, or forward only)
            self._finalize()
        if not next(iter(self._layers.values())).training:
            self._sampling = False  # eval forwards are not steps
            return
        self.step += 1
        self._sampling = self.step % self.every == 0
        if self._sampling:
            self._prior_stance = _set_stance(DynamoStance("force_eager"))
            self._set_eager(True)

    @torch._dynamo.disable
    def _on_model_output(self, module, args, output) -> None:
        self._restore_stance()
        self._set_eager(False)
        if self._sampling and not self._backward_pending:
            # no gemm of this step will run a backward: the step is complete
            self._finalize()

    def _set_eager(self, eager: bool) -> None:
        for mod in self._layers.values():
            if isinstance(mod, _Monitored) and mod._monitor_eager != eager:
                mod._monitor_eager = eager

    def _restore_stance(self) -> None:
        if self._prior_stance is not None:
            _set_stance(self._prior_stance)
            self._prior_stance = None

    def _forward_hook(self, fqn: str, mod: Float8Linear) -> Callable:
        def hook(module, args, output):
            if not self._sampling or is_recomputing():
                return
            self._measure_forward(fqn, mod, args[0], output)

        return hook

    @torch._dynamo.disable  # traced inside a compiled frame: runs eagerly on real tensors
    @torch.no_grad()
    def _measure_forward(self, fqn, mod, x, output) -> None:
        x2d = _layer_input(x)  # reads the autocast state: before disabling it
        with torch.autocast(x.device.type, enabled=False):  # the reference is fp32
            weight = mod.weight
            bias = None if mod.bias is None else mod.bias.float()
            ref = F.linear(x.float(), weight.float(), bias)
            self._pending[(fqn, "output")] = _gemm_sums(mod, "output", ref, output, x2d, weight)
        node = _matmul_node(output) if output.requires_grad else None
        if node is None:
            return
        x_keep = x2d.detach()

        def backward_hook(grad_inputs, grad_outputs):
            self._measure_backward(fqn, mod, x_keep, grad_inputs, grad_outputs)

        node.register_hook(backward_hook)
        self._backward_pending = True

    @torch.no_grad()
    def _measure_backward(self, fqn, mod, x, grad_inputs, grad_outputs) -> None:
        w = mod.weight  # the unsharded weight again in backward under FSDP2
        go = grad_outputs[0].reshape(-1, w.shape[0]).contiguous()  # rows, as the gemms see them
        grad_input, grad_weight = grad_inputs[0], grad_inputs[1]
        grad_input = None if grad_input is None else grad_input.reshape(-1, w.shape[1])
        with torch.autocast(x.device.type, enabled=False):  # the references are fp32
            if grad_input is not None:
                ref = go.float() @ w.float()
                self._pending[(fqn, "grad_input")] = _gemm_sums(
                    mod, "grad_input", ref, grad_input, go, w
                )
            if grad_weight is not None:
                ref = go.float().t() @ x.float()
                self._pending[(fqn, "grad_weight")] = _gemm_sums(
                    mod, "grad_weight", ref, grad_weight, go, x
                )
        if not self._callback_queued:
            # once per step: complete the step when the whole backward has run
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    # ------------------------------------------------------------------ the step's numbers

    def _finalize(self) -> None:
        """Reduce the pending step's sums (one all_reduce under torch.distributed), turn them
        into rows, log them and apply the guardrail."""
        self._backward_pending = self._callback_queued = False
        if not self._pending:
            return
        keys = sorted(self._pending)
        flat = torch.cat([torch.cat(self._pending[k]) for k in keys]).double()
        self._pending = {}
        world = 1
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size(self.group)
            if world > 1:
                if dist.get_backend(self.group) == "nccl" and not flat.is_cuda:
                    flat = flat.cuda()
                dist.all_reduce(flat, group=self.group)
        values = flat.cpu().tolist()  # the one host sync of a sampled step
        n = 2 + 2 * _OPERAND_SUMS  # per gemm: powers, then its two operands' sums
        by_key = {key: values[i * n : (i + 1) * n] for i, key in enumerate(keys)}
        rows = []
        for layer in self._layers:
            for gemm in GEMMS:
                v = by_key.get((layer, gemm))
                if v is not None:
                    rows.append(self._row(layer, gemm, v, world))
        self.history.extend(rows)
        self._log(rows)
        self._guardrail(rows)

    def _row(self, layer: str, gemm: str, v: list[float], world: int) -> dict:
        db = _sqnr_db(v[0], v[1])
        operands = {}
        for j, (name, _, field, _) in enumerate(_OPERANDS[gemm]):
            start = 2 + j * _OPERAND_SUMS
            clamped, numel, under, nonzero, scale = v[start : start + _OPERAND_SUMS]
            mod = self._layers[layer]
            if not getattr(mod.config, field).enabled or isinstance(mod, _HpFallback):
                continue
            operands[name] = {
                "saturated": clamped / numel if numel else 0.0,
                "underflow": under / nonzero if nonzero else 0.0,
                "scale": scale / world,
            }
        return {
            "layer": layer,
            "gemm": gemm,
            "sqnr_db": db,
            "saturated": max((o["saturated"] for o in operands.values()), default=0.0),
            "underflow": max((o["underflow"] for o in operands.values()), default=0.0),
            "step": self.step,
            "fallback": isinstance(self._layers[layer], _HpFallback),
            "operands": operands,
        }

    def _log(self, rows: list[dict]) -> None:
        if self.log_path is None or not rows:
            return
        if dist.is_available() and dist.is_initialized() and dist.get_rank(self.group) != 0:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as f:
            for r in rows:
                f.write(json.dumps({**r, "sqnr_db": _finite_or_none(r["sqnr_db"])}) + "\n")

    def _guardrail(self, rows: list[dict]) -> None:
        limit = self.fallback_below_db
        if limit is None:
            return
        for r in rows:
            if r["fallback"] or (self.fallback_on == "output" and r["gemm"] != "output"):
                continue
            # not `db < limit`: a NaN SQNR (a NaN or inf in the result) is below any floor
            below = not r["sqnr_db"] >= limit
            if below and not isinstance(self._layers[r["layer"]], _HpFallback):
                self._switch_to_hp(r["layer"])
                self.fallbacks.append({k: r[k] for k in ("layer", "gemm", "sqnr_db", "step")})
                warnings.warn(
                    f"Float8Monitor: layer {r['layer']!r} {r['gemm']} SQNR "
                    f"{r['sqnr_db']:.1f} dB < fallback_below_db={limit} at step {r['step']} "
                    f"(saturated {r['saturated']:.2%}, underflow {r['underflow']:.2%}): "
                    "it runs in hp from the next step on",
                    stacklevel=2,
                )

    def _switch_to_hp(self, layer: str) -> None:
        mod = self._layers[layer]
        if not isinstance(mod, _HpFallback):
            mod.__class__ = _hp_class(type(mod))
