"""Device flags brought to the host without a sync: warnings about non-finite amax records
and stale all-gather scales, and the host-side "DELAYED scale is set" marks, raised from
``precompute_scales`` (float8kit.precompute) and the FSDP2 float8 all-gather's scale
contributions (float8kit.distributed.fsdp) through one custom op, ``report_flags``.

Internal.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable

import torch
from torch import nn


class _HostReport:
    """Brings small device flags to the host without stalling it.

    On CPU the flags are handled at once (no device to wait for). On CUDA they are copied to
    pinned host memory asynchronously and handled later: by ``poll`` once the copy has
    completed (``wait=False``: usually the next ``precompute_scales`` call), or by ``drain``
    at the next call at the latest (``wait=True``: waits for a copy issued a whole step
    earlier, which has long completed, so every rank handles it at the same call).
    """

    def __init__(self, handle: Callable[[list[bool], list], None], wait: bool):
        self._handle, self._wait = handle, wait
        self._pending: collections.deque = collections.deque()

    def submit(self, flags: torch.Tensor, targets: list) -> None:
        self.poll()
        if flags.device.type != "cuda":
            self._handle(flags.tolist(), targets)
            return
        host = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((host, event, targets))

    def poll(self) -> None:
        while self._pending and (self._wait or self._pending[0][1].query()):
            host, event, targets = self._pending.popleft()
            event.synchronize()
            self._handle(host.tolist(), targets)


def _warning(message: str) -> Callable[[list[bool], list[str]], None]:
    """A ``_HostReport`` handler: warns ``message`` (``{layers}``: the flagged names)."""

    def handle(flags: list[bool], names: list[str]) -> None:
        layers = [name for name, flagged in zip(names, flags, strict=True) if flagged]
        if layers:
            warnings.warn(message.format(layers=", ".join(layers)), UserWarning, stacklevel=2)

    return handle


_NON_FINITE_MESSAGE = (
    "float8kit: non-finite amax recorded for {layers}: not folded into the amax history, the "
    "scale keeps its previous value (that step's float8 outputs were already non-finite)"
)
_STALE_WEIGHT_MESSAGE = (
    "float8kit: the weight of {layers} changed after precompute_scales() without a version "
    "bump (an update through param.data, e.g. an EMA or a custom optimizer): its last float8 "
    "all-gather used a stale scale. Call precompute_scales(model) after every such update."
)


def _mark_scales_set(is_set: list[bool], targets: list[list[tuple[nn.Module, str]]]) -> None:
    # one flag per scale buffer; a tied one marks every layer that shares it
    for ok, mods in zip(is_set, targets, strict=True):
        for mod, operand in mods:
            if ok:
                mod.fp8_state.mark_scales_set(operand)


SCALES_SET = _HostReport(_mark_scales_set, wait=True)
# Warnings raised from device flags, by kind (the ``kind`` argument of report_flags).
_REPORTS = {
    "non_finite": _HostReport(_warning(_NON_FINITE_MESSAGE), wait=False),  # inf/NaN records
    "stale_weight": _HostReport(_warning(_STALE_WEIGHT_MESSAGE), wait=False),  # see fsdp.py
}
# Counts report_flags calls: a mutated input keeps the op in compiled graphs (an op with no
# output and no mutated input would be dead code to inductor).
REPORT_CALLS = torch.zeros((), dtype=torch.int64)


# A custom op so that a compiled precompute_scales stays one graph: dynamo does not trace
# into it, and it runs (on the host) at every call.
@torch.library.custom_op("float8kit::report_flags", mutates_args=("calls",))
def report_flags(calls: torch.Tensor, flags: torch.Tensor, kind: str, names: str) -> None:
    """Warn (without a host sync on CUDA) about the items whose flag is set.

    Args:
        calls: a CPU counter, incremented.
        flags: (R,) bool, one flag per item.
        kind: which warning (a key of ``_REPORTS``).
        names: the R items' names, newline-separated.
    """
    calls += 1
    _REPORTS[kind].submit(flags, names.split("\n"))


@report_flags.register_fake
def _(calls: torch.Tensor, flags: torch.Tensor, kind: str, names: str) -> None:
    return None
