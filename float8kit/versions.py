"""Every torch-version probe of float8kit, in one place: what the running torch can do (and,
``mx_kernels_supported``, what the GPU can: the MX kernels need sm100).

The library supports torch 2.11 to 2.15. Where releases differ, the code asks one of these
(by capability where torch offers a probe, by version where only the version tells), never
``torch.__version__`` inline.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch
import torch.distributed as dist

TORCH_VERSION: tuple[int, int] = tuple(int(v) for v in torch.__version__.split(".")[:2])

# The single-tensor all-gather of torch.distributed: all_gather_single from torch 2.13 on
# (which deprecates all_gather_into_tensor, with a FutureWarning per call), before it
# all_gather_into_tensor. Looked up by name at each call (collective counters patch it).
ALL_GATHER_SINGLE: str = (
    "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
)

# torch 2.11's dynamo cannot trace the call of a Placement's method (``Shard(d).
# _to_replicate_tensor``: "Dynamo does not know how to trace method"); from 2.13 on it can.
PLACEMENT_METHODS_TRACE: bool = TORCH_VERSION >= (2, 13)

# torch 2.11's CPU inductor fuses two MX casts of one tensor along different dims (an
# operand and its grad_weight copy) into one kernel that it then fails to generate (an
# AssertionError in its loop split); 2.13 compiles them. Below, the MX cast is an opaque op
# to compiled CPU graphs (2.12 not tried: treated as 2.11).
CPU_INDUCTOR_FUSES_MX_CASTS: bool = TORCH_VERSION >= (2, 13)


@functools.cache
def cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes rowwise scales (torch 2.11's takes
    per-tensor scales only: "Now _scaled_mm only supports per-tensor scaling for CPU
    backend"). Probed once, with a 16x16 gemm."""
    a = torch.ones((16, 16)).to(torch.float8_e4m3fn)
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        torch._scaled_mm(
            a, a.t(), scale_a=torch.ones((16, 1)), scale_b=torch.ones((1, 16)),
            out_dtype=torch.bfloat16,
        )  # fmt: skip
        return True
    except RuntimeError:
        return False
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def premul_sum_factor(op) -> float | None:
    """A PREMUL_SUM reduce op's factor where torch shows it (``op.factor``); None on torch
    2.11, whose ``ReduceOp`` keeps that factor in C++."""
    return float(op.factor) if hasattr(op, "factor") else None


# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA) that keep its native bf16 matmul:
# AVX512_CORE_BF16 and every ISA above it (AMX, AVX10, AVX512_CORE_FP16) or no cap at all
# (ALL, or DEFAULT: oneDNN's name for no cap).
_BF16_ISA_MARKS = ("BF16", "AMX", "AVX10", "FP16", "ALL", "DEFAULT")
CPU_HP_DTYPE_ENV = "FLOAT8KIT_CPU_HP_DTYPE"
_HP_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs torch's bf16 matmul natively (AVX512-BF16 or AMX, and oneDNN not
    capped below them by ``ONEDNN_MAX_CPU_ISA``). Without it (AVX2-only CPUs, many cloud VMs
    and laptops) torch 2.13 emulates bf16 matmuls many times slower than fp32
    (numbers/cpu_dtype.json)."""
    if not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
        return False
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL"
    return any(mark in cap.upper() for mark in _BF16_ISA_MARKS)


def cpu_hp_dtype() -> torch.dtype:
    """The high-precision dtype a CPU run should compute in: bf16 where the CPU has it natively,
    fp32 otherwise. ``FLOAT8KIT_CPU_HP_DTYPE=float32`` (or ``bfloat16``) overrides the probe,
    e.g. to reproduce an AVX2-only machine's runs on one with bf16."""
    forced = os.environ.get(CPU_HP_DTYPE_ENV)
    if forced:
        if forced not in _HP_DTYPES:
            raise ValueError(f"{CPU_HP_DTYPE_ENV}={forced!r}: expected one of {sorted(_HP_DTYPES)}")
        return _HP_DTYPES[forced]
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cuda_device_name(index: int | None = None) -> str | None:
    """The name torch reports for CUDA device ``index`` (default: the current one), e.g.
    ``"NVIDIA H100 80GB HBM3"``; None where this torch or machine has no CUDA."""
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if index is not None and not 0 <= index < count:
        raise ValueError(f"cuda:{index}: this machine has {count} CUDA device(s)")
    return torch.cuda.get_device_name(index)


# The MX kernels (``torch._scaled_mm`` with e8m0 blocked scales, ``torch._scaled_grouped_mm``
# with MX operands) run on Blackwell (sm100) and later; on sm90 cuBLAS answers
# CUBLAS_STATUS_NOT_SUPPORTED from its heuristic, deep inside the first gemm.
MX_MIN_CAPABILITY: tuple[int, int] = (10, 0)


def _cuda_capability(index: int | None) -> tuple[int, int] | None:
    """CUDA device ``index``'s (default: the current one's) capability; None without a GPU."""
    if not torch.cuda.is_available():
        return None
    return _capability_of(torch.cuda.current_device() if index is None else index)


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


# A constant to torch.compile: dynamo calls it while tracing and bakes its answer into the
# graph, so the check costs no graph break and nothing per step.
@torch.compiler.assume_constant_result
def mx_kernels_supported(index: int | None = None) -> bool:
    """Whether CUDA device ``index`` (default: the current one) runs the MX kernels: CUDA
    capability >= 10.0 (sm100, Blackwell). True where there is no GPU to ask: a CUDA build of
    torch without one traces the CUDA paths on fake tensors (tests/test_fake_cuda.py)."""
    capability = _cuda_capability(index)
    return capability is None or capability >= MX_MIN_CAPABILITY


def require_mx_kernels(
    device: torch.device,
    config: str,
    instead: str,
    what: str = "the mxfp8 recipe's MX gemms",
    fmt: str = "MX",
) -> None:
    """Raise before any MX kernel runs on a CUDA ``device`` that cannot run it (see
    ``mx_kernels_supported``). The message names the way out: ``config`` the config class
    (``Float8LinearConfig``, ``Float8ExpertsConfig``) whose ``emulate`` field runs MX in fp32,
    ``instead`` the recipes this GPU runs."""
    if mx_kernels_supported(device.index):
        return
    index = torch.cuda.current_device() if device.index is None else device.index
    major, minor = _cuda_capability(index)
    raise RuntimeError(
        f"float8kit: {what} need an sm100 (Blackwell) GPU, CUDA "
        f"capability >= 10.0; {torch.cuda.get_device_name(index)} (cuda:{index}) is "
        f"sm{major}{minor}. Use a float8 recipe ({instead}) on this GPU, or "
        f"{config}(emulate=True) to emulate {fmt} in fp32"
    )


# Whether the running code is traced for a compiled graph. ``torch.compiler.is_compiling()``
# says so while dynamo traces; an autograd Function that dynamo puts in the graph whole
# (``allow_in_graph``: ``linear._Float8Matmul``, whose body dynamo then installs no guards
# for) runs under AOTAutograd's trace instead, where torch 2.13 keeps that flag set and 2.11
# does not. Such a Function says which it is (``compiled_trace``), for 2.11 as for 2.13.
# ``direct``: inside an eager pass of such a Function (``compiled_trace(False)``),
# ``eager_direct`` as decided once at its start (a pass asks about ten times). Per thread:
# autograd runs a CUDA backward on the device's thread, and one pass must not decide another's.
class _PassState(threading.local):
    compiled_trace, direct = False, None


_PASS = _PassState()


def compiling() -> bool:
    """``torch.compiler.is_compiling()``, also inside an allow_in_graph Function traced for
    a compiled graph (see ``compiled_trace``)."""
    if _PASS.direct:  # an eager pass that runs ops directly is not compiling
        return False
    return torch.compiler.is_compiling() or _PASS.compiled_trace


def eager_direct() -> bool:
    """Whether float8kit may run an op's implementation directly, without the dispatcher's
    round trip (a custom op, or the float8 tensor's ``__torch_dispatch__``): eager, no
    torch dispatch mode on the stack (a selective activation checkpointing policy, fake
    tensors, a flop counter: each sees every op as it always does) and no profiler running
    (a profile shows float8kit's ops as their own events). The same function runs either
    way: only the host time differs."""
    decided = _PASS.direct
    if decided is not None:
        return decided
    return (
        not compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._autograd._profiler_enabled()
    )


def compiled_trace(compiled: bool):
    """Runs the body as part of a compiled graph's trace when ``compiled`` (decided by the
    caller while dynamo traces it): ``compiling()`` is True inside. Otherwise an eager pass,
    which decides ``eager_direct`` once for the body."""
    return _traced() if compiled else _EagerPass()


class _EagerPass:
    """``eager_direct`` fixed for the body (a class, not a generator: an eager call's cost)."""

    __slots__ = ("before",)

    def __enter__(self):
        self.before, _PASS.direct = _PASS.direct, None  # not an enclosing pass's decision
        _PASS.direct = eager_direct()

    def __exit__(self, *exc):
        _PASS.direct = self.before


@contextlib.contextmanager
def _traced():
    before, _PASS.compiled_trace = _PASS.compiled_trace, True
    try:
        yield
    finally:
        _PASS.compiled_trace = before
