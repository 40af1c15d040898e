"""AdamW with block-quantized states (float8kit.optim.states): ``AdamW8bit``, ``AdamW4bit``.

Drop-in for ``torch.optim.AdamW`` (same arguments and defaults; amsgrad and the foreach,
fused, capturable and differentiable implementations refused by name). Each step decodes a
parameter's m and sqrt(v) to fp32, updates them and the parameter in fp32 (AdamW's decoupled
weight decay, bias corrections), and encodes the new states; the parameter is written back in
its own dtype.

Which parameters keep fp32 states instead (``exp_avg`` and ``exp_avg_sq``, as torch's AdamW):
those with fewer than 2 dims (biases, norms: under FSDP2 their dim-0 shards would cut blocks)
and those with fewer than ``min_quantized_numel`` elements. Both are decided on the global
shape, so a parameter keeps the same kind of state on any mesh.

Under FSDP2 a parameter is a DTensor and so is each of its states (same mesh and placements,
rows along dim 0), so ``get_state_dict``/``set_state_dict`` and torch.distributed.checkpoint
save and reshard them like any optimizer state. Blocks run along the trailing dims, so shards
of dim 0 (FSDP2's, HSDP's, tensor parallel colwise weights) never cut one; a 2-D weight's
dim-1 shards (tensor parallel rowwise) must hold whole blocks, or ``cut_blocks='fp32'`` keeps
fp32 states for it (refused by default: its numbers would depend on the mesh).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

import float8kit.optim.states as states
from float8kit.optim.states import Codec
from float8kit.tensor import wrap_local

# the quantized state's keys: m, and the root of v (not v: see states.py)
_QUANTIZED = ("exp_avg", "exp_avg_scale", "exp_avg_sq_root", "exp_avg_sq_root_scale")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(param: torch.Tensor, local: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``local`` (this rank's rows of a state of global ``shape``) as ``param`` holds its own:
    a DTensor on the parameter's mesh and placements, or itself."""
    return wrap_local(local, param, shape) if isinstance(param, DTensor) else local


def _cut_blocks(p: torch.Tensor, block: int, bits: int) -> str | None:
    """Why ``p``'s placements would cut a state block between ranks, or None. Shards of dim 0
    never do (blocks run along a row). A 2-D parameter's dim-1 shards (tensor parallel
    rowwise weights) do not when every shard holds whole blocks (two-code bytes too)."""
    if not isinstance(p, DTensor):
        return None
    shards = 1
    for placement, size in zip(p.placements, p.device_mesh.shape, strict=True):
        if isinstance(placement, Replicate) or (
            isinstance(placement, Shard) and placement.dim == 0
        ):
            continue
        if type(placement) is Shard and placement.dim == 1 and p.dim() == 2:
            shards *= size
            continue
        return f"{placement!r} would cut a row's blocks between ranks"
    cols = p.shape[-1]
    if shards > 1 and (cols % shards or (cols // shards) % block or (cols // shards) % (8 // bits)):
        return (
            f"its {cols} columns over {shards} ranks are not whole blocks of {block} on every rank"
        )
    return None


# Rows a quantized parameter's step decodes at a time: its fp32 temporaries (m, v, the root,
# the update, the gradient) stay near this many elements each, about 64 MB.
CHUNK_ELEMENTS = 2**24


def root(v: torch.Tensor) -> torch.Tensor:
    """sqrt(v) correctly rounded to fp32 on every device: torch's CPU fp32 sqrt is not (about
    one element in 150 is an ulp off), CUDA's is; the fp64 root, rounded once, is on both."""
    return torch.sqrt(v.to(torch.float64)).to(torch.float32)


def _adamw(param, grad, m, v, group: dict, step: float) -> tuple[torch.Tensor, ...]:
    """AdamW's step in fp32: the new (parameter, m, v, sqrt(v)) from ``param``, ``grad`` and
    the decoded ``m``, ``v`` (same shapes). Only correctly rounded elementwise operations (no
    fused multiply-add, no lerp, no division by a Python number, which CUDA rounds otherwise:
    ``states.divide``; the root from fp64: ``root``), so an element's result does not depend
    on the length of the shard it sits in, nor, by design, on the device (tests/test_gpu.py)."""
    beta1, beta2 = group["betas"]
    lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
    grad = grad.to(torch.float32)
    if group["maximize"]:
        grad = -grad
    m = m * beta1 + grad * (1 - beta1)
    v = v * beta2 + (grad * grad) * (1 - beta2)
    r = root(v)
    x = param.to(torch.float32)
    if wd:
        x = x * (1 - lr * wd)
    denom = states.divide(r, math.sqrt(1 - beta2**step)) + eps
    return x - (m / denom) * (lr / (1 - beta1**step)), m, v, r


class _LowBitAdamW(torch.optim.Optimizer):
    """AdamW whose m and sqrt(v) are kept in ``codecs`` = (m's, sqrt(v)'s) per block."""

    codecs: tuple[Codec, Codec]

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        block_size: int = 128,
        min_quantized_numel: int = 4096,
        cut_blocks: str = "error",
    ):
        name = type(self).__name__
        if amsgrad:
            raise ValueError(
                f"{name}: amsgrad=True is not supported (its running max of v would be a "
                "third state to quantize); use torch.optim.AdamW(amsgrad=True)"
            )
        for field, value in [
            ("foreach", foreach),
            ("capturable", capturable),
            ("differentiable", differentiable),
            ("fused", fused),
        ]:
            if value:
                raise ValueError(
                    f"{name}: {field}={value!r} is not supported: it has one implementation "
                    f"(per parameter, states decoded and encoded per block); leave {field} unset"
                )
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            maximize=maximize,
            block_size=block_size,
            min_quantized_numel=min_quantized_numel,
            cut_blocks=cut_blocks,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, then the group checked: its settings (a group may override any of them)
        and its parameters (real floating point; a quantized one's shards hold whole
        blocks)."""
        super().add_param_group(param_group)
        group, g, name = self.param_groups[-1], len(self.param_groups) - 1, type(self).__name__
        where = f"{name}: param group {g}:" if g else f"{name}:"
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        block, smallest = group["block_size"], group["min_quantized_numel"]
        if not 0.0 <= float(lr):
            raise ValueError(f"{where} lr must be >= 0, got {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"{where} eps must be >= 0, got {eps}")
        for i, beta in enumerate(group["betas"]):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"{where} betas[{i}] must be in [0, 1), got {beta}")
        if not 0.0 <= wd:
            raise ValueError(f"{where} weight_decay must be >= 0, got {wd}")
        if not (isinstance(block, int) and block > 0):
            raise ValueError(f"{where} block_size must be a positive int, got {block!r}")
        if not (isinstance(smallest, int) and smallest >= 0):
            raise ValueError(f"{where} min_quantized_numel must be an int >= 0, got {smallest!r}")
        if group["cut_blocks"] not in ("error", "fp32"):
            raise ValueError(
                f"{where} cut_blocks must be 'error' or 'fp32', got {group['cut_blocks']!r}"
            )
        for i, p in enumerate(group["params"]):
            at = f"{name}: parameter {i} of param group {g}"
            if not p.is_floating_point() or p.is_complex():
                raise TypeError(
                    f"{at} is {p.dtype}: only real floating-point parameters have AdamW "
                    "states (keep integer buffers out of the optimizer; split a complex "
                    "parameter into real and imaginary parts)"
                )
            cut = _cut_blocks(p, block, self.codecs[0].bits)
            if cut and group["cut_blocks"] == "error" and self._large(p, group):
                raise ValueError(
                    f"{at} {tuple(p.shape)} is placed {p.placements}: {cut}. A state block "
                    "runs along a row; shards of dim 0 (FSDP2's) never cut one, a 2-D "
                    "weight's dim-1 shards (tensor parallel rowwise) must hold whole blocks. "
                    "Shard it so, pick a block_size that divides its shards, or pass "
                    "cut_blocks='fp32' to keep fp32 states for such parameters (their "
                    "numbers then depend on the mesh)"
                )

    @staticmethod
    def _large(p: torch.Tensor, group: dict) -> bool:
        """Whether ``p`` is large enough for block-quantized states (its global shape)."""
        return p.dim() >= 2 and p.numel() >= group["min_quantized_numel"]

    def _quantized(self, p: torch.Tensor, group: dict) -> bool:
        """Whether ``p`` keeps block-quantized states: decided on its global shape (any mesh
        agrees), unless ``cut_blocks='fp32'`` gives fp32 states to a parameter whose shards
        would cut blocks."""
        return (
            self._large(p, group)
            and _cut_blocks(p, group["block_size"], self.codecs[0].bits) is None
        )

    def _init_state(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        local = _local(p)
        if not self._quantized(p, group):
            for key in ("exp_avg", "exp_avg_sq"):
                zero = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
                state[key] = _like(p, zero, tuple(p.shape))
            return
        rows, cols, block = p.shape[0], math.prod(p.shape[1:]), group["block_size"]
        local_cols = math.prod(local.shape[1:])  # cols / the dim-1 shards (whole blocks)
        for key, codec in zip(_QUANTIZED[::2], self.codecs, strict=True):
            codes, scale = states.zeros(local.shape[0], local_cols, codec, block, local.device)
            state[key] = _like(p, codes, (rows, states.code_cols(codec, cols)))
            state[f"{key}_scale"] = _like(p, scale, (rows, states.scale_cols(cols, block)))

    # Eager even inside torch.compile (a compiled training step breaks its graph here): dynamo
    # traces the per-parameter loop wrongly (torch 2.13 mixes parameters across its resume
    # frames; tests/test_optim_adamw.py), and the step is elementwise work per parameter.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step for every parameter with a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"{type(self).__name__} does not take sparse gradients (an "
                        "nn.Embedding(sparse=True)?): use dense gradients, or "
                        "torch.optim.SparseAdam for that parameter"
                    )
                if not self.state[p]:
                    self._init_state(p, group)
                self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        """One step of ``p`` on this rank's rows; quantized states ``CHUNK_ELEMENTS`` at a
        time (whole rows: a row's blocks never split), so the fp32 temporaries stay small
        whatever the parameter's size."""
        state = self.state[p]
        state["step"] += 1
        step = state["step"].item()
        grad = p.grad
        if isinstance(grad, DTensor) and grad.placements != p.placements:
            # tensor parallel: a replicated or partial gradient of a sharded weight
            grad = grad.redistribute(p.device_mesh, p.placements)
        param, grad = _local(p), _local(grad)
        if "exp_avg_scale" not in state:  # fp32 states, in the parameter's shape
            m, v = (_local(state[k]) for k in ("exp_avg", "exp_avg_sq"))
            x, m_new, v_new, _ = _adamw(param, grad, m, v, group, step)
            param.copy_(x)
            m.copy_(m_new)
            v.copy_(v_new)
            return
        rows, cols, block = param.shape[0], math.prod(param.shape[1:]), group["block_size"]
        (m_codec, root_codec), keys = self.codecs, [_local(state[k]) for k in _QUANTIZED]
        param_rows, grad_rows = param.reshape(rows, cols), grad.reshape(rows, cols)
        out = torch.empty((rows, cols), dtype=param.dtype, device=param.device)
        chunk = max(1, CHUNK_ELEMENTS // max(cols, 1))
        for r in range(0, rows, chunk):
            at = slice(r, r + chunk)
            m = states.dequantize(keys[0][at], keys[1][at], m_codec, block, cols)
            v = states.dequantize(keys[2][at], keys[3][at], root_codec, block, cols) ** 2
            x, m, _, root = _adamw(param_rows[at], grad_rows[at], m, v, group, step)
            out[at] = x
            for i, (value, codec) in enumerate(zip((m, root), self.codecs, strict=True)):
                codes, scale = states.quantize(value, codec, block)
                keys[2 * i][at] = codes
                keys[2 * i + 1][at] = scale
        param.copy_(out.reshape(param.shape))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then each state back in the dtype it was saved in: torch casts every
        floating-point state to its parameter's dtype (the fp32 scales and states of a bf16
        parameter would lose bits; the codes would become floats)."""
        super().load_state_dict(state_dict)
        saved_groups = state_dict["param_groups"]
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            for p, key in zip(group["params"], saved["params"], strict=True):
                for name, value in state_dict["state"].get(key, {}).items():
                    if name != "step" and isinstance(value, torch.Tensor):
                        self.state[p][name] = value.to(device=_local(p).device)


class AdamW8bit(_LowBitAdamW):
    """AdamW with m and sqrt(v) in e4m3 per block of ``block_size`` (default 128) elements
    along each row: per state, 1 byte per element + an fp32 scale per block (fp32 AdamW
    keeps 4 bytes per element per state). See float8kit.optim.adamw for which parameters
    keep fp32 states and how FSDP2 shards them."""

    codecs = (states.E4M3_CODEC, states.E4M3_ROOT)


class AdamW4bit(_LowBitAdamW):
    """AdamW with m in e2m1 and sqrt(v) as powers of sqrt(2), per block of ``block_size``
    (default 128) elements along each row: per state, two codes per byte + an fp32 scale per
    block."""

    codecs = (states.E2M1_CODEC, states.ROOT4)
