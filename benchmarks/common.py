"""Helpers shared by the benchmark scripts in this folder (never imported by float8kit).

Every script in ``benchmarks/`` runs on its own (``python benchmarks/bench_linear.py``); Python
puts this folder on ``sys.path``, so they ``import common``. What lives here is what every
script must do the same way: describe the machine (device, torch, torchao, date, command),
time a callable (CUDA events on GPU, ``time.perf_counter`` on CPU, median after warm-up),
measure SQNR against a reference, print a markdown table, and write JSON + markdown.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import functools
import importlib.metadata
import json
import logging
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"

# Run from a checkout without `pip install`: float8kit sits next to benchmarks/. Appended,
# so a PYTHONPATH naming another checkout (a feature branch's worktree) wins.
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))


# ----------------------------------------------------------------------------
# the peer (torchao.float8) and float8kit's optional features


def _via_our_cpu_kernel(real):
    """``torch._scaled_mm`` that sends CPU calls (no bias, no output scale) to float8kit's CPU
    kernel, ``float8kit::cpu_scaled_mm``: torch's own kernel, with oneDNN off for the call."""
    import float8kit.gemm

    # wraps: the stand-in keeps the builtin's name. Inductor names its extern gemm after
    # ``torch._scaled_mm.__name__`` when it first imports its lowerings; a graph compiled in a
    # process without the stand-in (a test run) and loaded from the FX graph cache by one with
    # it called ``extern_kernels._scaled_mm``, registered there as ``scaled_mm``
    # ("'KernelNamespace' object has no attribute '_scaled_mm'").
    @functools.wraps(real)
    def scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, **kw):
        # inside our custom op oneDNN is off: that call is ours, to the real kernel
        inside_ours = not torch.compiler.is_compiling() and not torch._C._get_mkldnn_enabled()
        if a.is_cuda or bias is not None or scale_result is not None or inside_ours:
            return real(a, b, scale_a, scale_b, bias, scale_result, out_dtype, **kw)
        # the op, or in eager its body directly (float8kit's own calls are made so too)
        return float8kit.gemm._cpu_kernel(
            a, b, scale_a, scale_b, out_dtype, kw.get("use_fast_accum", False)
        )

    scaled_mm.real = real
    return scaled_mm


@contextlib.contextmanager
def peer_on_our_cpu_kernel():
    """Run torchao.float8's ``torch._scaled_mm`` calls on float8kit's CPU kernel, so that a
    comparison compares the two libraries, not two CPU kernels: on AVX512-FP16/AMX CPUs torch
    hands a direct e4m3 x e4m3 call (torchao's) to oneDNN's reference matmul, which sums in
    another order and runs ~1000x slower. CUDA calls are untouched."""
    real = torch._scaled_mm
    torch._scaled_mm = _via_our_cpu_kernel(real)
    try:
        yield
    finally:
        torch._scaled_mm = real


def import_torchao_float8():
    """``(torchao.float8, version)`` or ``(None, error text)``; quiet about torchao's
    optional CUDA extensions, which fail to load on CPU-only machines and say so loudly."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    # torch logs (not warns) that torchao registers Enum subclasses as pytree constants
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="torchao")
    warnings.filterwarnings("ignore", message=".*KernelPreference.*")
    try:
        import torchao
        import torchao.float8 as ao_float8
    except Exception as e:  # noqa: BLE001  (any import failure means "peer not available")
        return None, f"{type(e).__name__}: {e}"
    # For the whole benchmark process: the peer's CPU gemms on float8kit's CPU kernel
    # (peer_on_our_cpu_kernel). Not on a CUDA machine: there every gemm (the compiled graphs'
    # extern kernel included) must be the builtin, not a Python function in front of it, or
    # the stand-in's call would be timed as the libraries' host cost.
    if not torch.cuda.is_available() and not hasattr(torch._scaled_mm, "real"):
        torch._scaled_mm = _via_our_cpu_kernel(torch._scaled_mm)
    return ao_float8, torchao.__version__


def torchao_version() -> str | None:
    """The installed torchao's version, without importing it (that takes seconds)."""
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def float8kit_recipes() -> list[str]:
    """The named recipes of float8kit (``Float8Recipe``)."""
    import float8kit

    return [r.value for r in float8kit.Float8Recipe]


# Benchmark-only recipe names beside float8kit's named recipes (``float8kit_config``).
BENCH_RECIPES = ("static",)


def float8kit_config(recipe: str):
    """float8kit's config for a named recipe, or for ``"static"``: STATIC scaling of all
    three operands with fixed power-of-two scales fit for the benchmarks' operands (what
    ``calibrate`` would set for them): randn inputs (|x| < 6: scale 32, amax 192 of e4m3's
    448), ``nn.Linear``'s default init (|w| <= 1 / sqrt(K), K >= 256: 4096) and randn
    gradients (e5m2: 4096). Bytes and time do not depend on the values."""
    import float8kit
    from float8kit import CastConfig, ScalingType

    if recipe == "static":

        def static(scale: float) -> CastConfig:
            return CastConfig(scaling_type=ScalingType.STATIC, static_scale=scale)

        return float8kit.Float8LinearConfig(
            cast_config_input=static(32.0),
            cast_config_weight=static(4096.0),
            cast_config_grad_output=static(4096.0),
        )
    return float8kit.Float8LinearConfig.from_recipe_name(recipe)


def runnable_recipes(device: torch.device, recipes: Sequence[str]) -> tuple[list[str], list[str]]:
    """``recipes`` split into those ``device`` runs and, for the rest, ``"<recipe>: <why
    not>"``: an MX recipe on a CUDA GPU before sm100 (``float8kit.versions.
    mx_kernels_supported``), whose gemms would raise float8kit's error at the first call."""
    import float8kit
    from float8kit import versions

    run, skipped = [], []
    for recipe in recipes:
        if recipe not in float8kit_recipes():
            run.append(recipe)  # not ours to judge: the script records what float8kit says
            continue
        config = float8kit.Float8LinearConfig.from_recipe_name(recipe)
        casts = [
            getattr(config, name) for names in config.operand_uses().values() for name in names
        ]
        kind = (
            "MX"
            if any(c.scaling_granularity is float8kit.ScalingGranularity.MX for c in casts)
            else "NVFP4"
            if any(c.scaling_granularity is float8kit.ScalingGranularity.NVFP4 for c in casts)
            else None
        )
        if kind and device.type == "cuda" and not versions.mx_kernels_supported(device.index):
            major, minor = torch.cuda.get_device_capability(device)
            skipped.append(
                f"{recipe}: its {kind} gemms need an sm100 (Blackwell) GPU; "
                f"{torch.cuda.get_device_name(device)} is sm{major}{minor}"
            )
        else:
            run.append(recipe)
    return run, skipped


def torchao_recipe_config(ao_float8, recipe: str):
    """torchao's config for ``recipe``, or raise ``ValueError`` saying why there is none."""
    try:
        return ao_float8.Float8LinearConfig.from_recipe_name(recipe)
    except (ValueError, KeyError, AssertionError) as e:
        raise ValueError(f"torchao {torchao_version()} has no recipe {recipe!r} ({e})") from None


# ----------------------------------------------------------------------------
# machine description


def pick_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


THREADS_HELP = "CPU: torch threads (default: torch's choice; 1 is steadier on a shared box)"


def set_threads(n: int | None) -> None:
    """``--threads``: on a shared CPU one thread gives steadier medians than a contended pool."""
    if n:
        torch.set_num_threads(n)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def device_slug(device: torch.device) -> str:
    """Short name for result file names: ``cpu``, ``h100``, ``h200``, ..."""
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device).lower()
    m = re.search(r"\b([a-z]\d{2,4}[a-z]?)\b", name)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def _git(*args: str, env: dict | None = None) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30, env=env
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> str | None:
    """The checkout's full commit hash (None outside a git checkout)."""
    return _git("rev-parse", "HEAD")


def git_tree() -> str | None:
    """The git tree hash of the files as they are (tracked and untracked, not ignored). A
    copy of the checkout on a device machine may carry stale git metadata (its HEAD and
    dirty flag then describe another tree); this hash is of the files that ran, and equals
    ``git rev-parse <commit>^{tree}`` of the commit they are. ``.whl/`` (the peer's wheels
    carried to a GPU machine, docs/gpu.md) is left out: the copy's git may not ignore it."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
        excludes = Path(tmp, "exclude")
        excludes.write_text("/.whl/\n")
        if _git("-c", f"core.excludesFile={excludes}", "add", "-A", ".", env=env) is None:
            return None
        return _git("write-tree", env=env)


# Results (numbers/) and prose (*.md) do not change what a script measures: a checkout whose
# only changes are there still runs the committed code. tools/numbers.py uses the same rule.
DIRTY_EXCLUDES = (":(exclude)numbers", ":(exclude,glob)**/*.md")


def git_dirty() -> bool | None:
    """True when tracked or untracked files outside numbers/ and *.md differ from HEAD."""
    status = _git("status", "--porcelain", "--", ".", *DIRTY_EXCLUDES)
    return None if status is None else bool(status)


def command_line() -> str:
    return " ".join(
        [
            "python",
            *map(shlex.quote, [os.path.relpath(sys.argv[0], REPO)]),
            *map(shlex.quote, sys.argv[1:]),
        ]
    )


def run_info(device: torch.device) -> dict:
    """The keys every result JSON starts with."""
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "torchao": torchao_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(),
        "script": os.path.relpath(os.path.abspath(sys.argv[0]), REPO),
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "git_tree": git_tree(),
        # what makes this result stale (tests/test_docs.py checks the ones in numbers/): the
        # script itself, these helpers and the library
        "sources": ["benchmarks/common.py", "float8kit"],
        # CPU timings on a shared machine move with its load: say what it was
        "load_avg_1m_5m_15m": [round(x, 2) for x in os.getloadavg()]
        if hasattr(os, "getloadavg")
        else None,
    }


# Where a run writes when no --out is given: ignored by git (runs/ is), so a benchmark run
# never dirties the checkout. Results meant to be committed go to RESULTS_DIR with --out.
RUNS_DIR = REPO / "runs" / "benchmarks"


def default_out(device: torch.device, kind: str, *variant: str) -> Path:
    """``runs/benchmarks/<date>-<device>-<kind>[-<variant>...].json``: the variant (preset,
    compiled or eager, ...) keeps runs with other flags from overwriting each other."""
    tags = "".join(f"-{v}" for v in variant if v)
    return RUNS_DIR / f"{datetime.date.today().isoformat()}-{device_slug(device)}-{kind}{tags}.json"


# ----------------------------------------------------------------------------
# timing and numerics


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(
    fn: Callable[[int], object],
    device: torch.device,
    *,
    warmup: int,
    iters: int,
    synced: bool = False,
) -> list[float]:
    """Per-call times in ms of ``fn(i)`` for ``i`` in ``range(iters)``, after ``warmup`` calls.

    ``fn`` takes the iteration number so callers can rotate pre-made inputs (caches must not
    flatter a benchmark that reuses one input). CUDA: one event pair per call, read after one
    synchronize at the end: back to back, the host queues the next call while the GPU runs
    this one (throughput). ``synced``: a synchronize after every call, as a training loop
    that reads ``loss.item()`` each step does: each call starts on an idle GPU, so the host
    time before its first kernel counts (latency). CPU: ``time.perf_counter`` (every call is
    synchronous: ``synced`` changes nothing).
    """
    for i in range(warmup):
        fn(i)
    sync(device)
    if device.type == "cuda":
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(iters)
        ]
        for i, (start, end) in enumerate(events):
            start.record()
            fn(i)
            end.record()
            if synced:
                torch.cuda.synchronize(device)
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``x`` against ``ref`` in dB (inf if equal)."""
    ref, x = ref.detach().double(), x.detach().double()
    noise = (ref - x).norm()
    if noise == 0:
        return math.inf
    return (20 * torch.log10(ref.norm() / noise)).item()


def finite_or_none(x: float | None, ndigits: int = 2) -> float | None:
    """JSON has no inf/nan: an exact match (inf dB) or a missing number is written as null."""
    if x is None or not math.isfinite(x):
        return None
    return round(x, ndigits)


class OpCounter(TorchDispatchMode):
    """The one aten op counter of float8kit's tests and benchmarks: records every op that
    runs while it is active (below autograd), with the dtype it was asked to produce.

    ``counts``: calls per op name; ``kernels``: the ops that are not views (each may launch
    a kernel); ``float8_casts``: hp -> float8 conversions (``_to_copy`` to a float8 dtype,
    or float8kit's one-pass tensorwise cast, ``float8kit::cast_tensorwise``)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtype = kwargs.get("dtype")
        if func is torch.ops.float8kit.cast_tensorwise.default:  # (hp, scale, fp8 dtype, ...)
            dtype = args[2]
        self.calls.append((func, dtype))
        return func(*args, **kwargs)

    @property
    def counts(self) -> collections.Counter:
        return collections.Counter(str(func) for func, _ in self.calls)

    @property
    def kernels(self) -> list[str]:
        return [str(func) for func, _ in self.calls if not func.is_view]

    @property
    def float8_casts(self) -> int:
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
        casts = (torch.ops.aten._to_copy.default, torch.ops.float8kit.cast_tensorwise.default)
        return sum(f in casts and d in fp8 for f, d in self.calls)


def count_aten_ops(module, m: int, k: int, n: int, backward: bool) -> int:
    """aten ops one fwd(+bwd) call of ``module`` on an (m, k) bf16 input dispatches: each is
    a kernel launch on a GPU in eager mode, and a trip through the dispatcher on any device."""
    p = next(module.parameters())
    x = torch.randn(m, k, dtype=torch.bfloat16, device=p.device, requires_grad=True)
    with OpCounter() as counter:
        y = module(x)
        if backward:
            y.backward(torch.randn(m, n, dtype=torch.bfloat16, device=p.device))
    for q in module.parameters():
        q.grad = None
    return len(counter.calls)


# ----------------------------------------------------------------------------
# output


def fmt(x, ndigits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        return f"{x:.{ndigits}f}" if abs(x) < 1e5 else f"{x:.3e}"
    return str(x)


def markdown_table(rows: list[dict], columns: list[tuple[str, str]], ndigits: int = 3) -> str:
    """``columns`` = [(key, header), ...]; missing keys print as ``-``."""
    lines = [
        "| " + " | ".join(h for _, h in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(k), ndigits) for k, _ in columns) + " |")
    return "\n".join(lines)


def header_lines(info: dict) -> str:
    return (
        f"- device: {info['device']}\n- torch: {info['torch']}, torchao: {info['torchao']}\n"
        f"- date: {info['date']}, git: {info.get('git_commit')}"
        f"{' (dirty)' if info.get('git_dirty') else ''}, "
        f"load average (1/5/15 min) at start: {info.get('load_avg_1m_5m_15m')}\n"
        f"- command: `{info['command']}`\n"
    )


def write_results(out: Path, payload: dict, table_md: str, title: str) -> tuple[Path, Path]:
    """Write ``out`` (JSON) and ``out`` with ``.md`` (title, run info, table)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")
    md = out.with_suffix(".md")
    md.write_text(f"# {title}\n\n{header_lines(payload)}\n{table_md}\n")
    return out, md
