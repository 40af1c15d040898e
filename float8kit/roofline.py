"""Predicted float8 speedup of one Linear's forward + backward on a GPU, and a module
filter that converts a layer only where the prediction says float8 wins.

The model, for an (M, K) x (K, N) layer (M = tokens) trained with a recipe:

    t(gemm)   = max(2MKN / (peak * gemm_eff), operand bytes / (hbm * hbm_eff))
    t(bf16)   = sum of its three bf16 gemms
    t(float8) = its gemms (fp8, or bf16 where the recipe keeps one in hp)
                + traffic / (hbm * hbm_eff) + kernels * kernel_us
    speedup   = t(bf16) / t(float8)

``traffic`` is what the recipe moves outside the gemms (amax reads, casts, layout
copies), per element of input (M*K), weight (K*N) and grad_output (M*N): the bytes
inductor schedules for one compiled layer, measured by ``benchmarks/bench_traffic.py``
(``TRAFFIC``; the ``traffic`` table in docs/performance.md). Peaks are the datasheets'
dense (no sparsity) numbers; the efficiencies say how much of them a real kernel gets and
are what a GPU measurement calibrates (``calibrate``, from ``benchmarks/bench_linear.py``
rows).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from float8kit.versions import cuda_device_name

# ----------------------------------------------------------------------------
# devices


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Datasheet peaks of one GPU (dense tensor-core rates, no sparsity)."""

    name: str
    bf16_tflops: float  # dense bf16 tensor-core peak, TFLOP/s
    fp8_tflops: float  # dense fp8 (e4m3/e5m2) tensor-core peak, TFLOP/s
    hbm_tbps: float  # HBM bandwidth, TB/s
    source: str  # where the numbers come from


DEVICES = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM column: BF16 1,979 and FP8 3,958 TFLOPS
    # "with sparsity" (dense is half), 3.35 TB/s HBM3.
    "h100": DeviceSpec(
        "NVIDIA H100 SXM", 989.5, 1979.0, 3.35, "NVIDIA H100 datasheet (SXM; dense = sparse / 2)"
    ),
    # NVIDIA H200 datasheet, SXM column: same tensor cores as H100 SXM (BF16 1,979, FP8
    # 3,958 TFLOPS with sparsity), 4.8 TB/s HBM3e.
    "h200": DeviceSpec(
        "NVIDIA H200 SXM", 989.5, 1979.0, 4.8, "NVIDIA H200 datasheet (SXM; dense = sparse / 2)"
    ),
    # NVIDIA HGX B200 datasheet, per GPU (8 per board): FP8 9 and BF16 4.5 PFLOPS with
    # sparsity (dense is half), 8 TB/s HBM3e.
    "b200": DeviceSpec(
        "NVIDIA B200",
        2250.0,
        4500.0,
        8.0,
        "NVIDIA HGX B200 datasheet (per GPU; dense = sparse / 2)",
    ),
}


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet peaks that real kernels reach; a GPU run calibrates them
    (``calibrate``). The defaults are H100 figures float8kit's design assumes (bf16 gemm
    ~800 TFLOP/s, fp8 ~1450, a streaming copy ~3 TB/s), not a measurement."""

    bf16_gemm: float = 0.8  # achieved / peak bf16 gemm rate
    fp8_gemm: float = 0.73  # achieved / peak fp8 gemm rate
    hbm: float = 0.9  # achieved / peak bandwidth of the memory-bound cast kernels
    kernel_us: float = 0.0  # fixed cost per extra kernel (launch, tail), microseconds

    def __post_init__(self):
        for f in ("bf16_gemm", "fp8_gemm", "hbm"):
            v = getattr(self, f)
            if not 0 < v <= 1:
                raise ValueError(f"Efficiency.{f}={v!r} must be in (0, 1]: achieved / peak")
        if self.kernel_us < 0:
            raise ValueError(f"Efficiency.kernel_us={self.kernel_us!r} must be >= 0")


# ----------------------------------------------------------------------------
# the traffic model


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes a recipe moves outside the gemms of one fwd+bwd, per element of each operand,
    the number of those kernels, and which gemms run in fp8 (output, grad_input,
    grad_weight)."""

    input: float
    weight: float
    grad_output: float
    kernels: int
    fp8_gemms: tuple[bool, bool, bool] = (True, True, True)

    def bytes(self, m: int, k: int, n: int) -> float:
        return self.input * m * k + self.weight * k * n + self.grad_output * m * n


# float8kit compiled (torch.compile, inductor), per recipe: benchmarks/bench_traffic.py's
# per-element split at 256x512x1024 (numbers/traffic.json holds the measured rows).
TRAFFIC = {
    "tensorwise": Traffic(8.0, 8.0, 8.0, 12),
    "delayed": Traffic(4.0, 4.0, 4.0, 10),
    "static": Traffic(4.0, 4.0, 4.0, 6),
    "rowwise": Traffic(6.0, 8.0, 6.0, 7),
    "rowwise_with_gw_hp": Traffic(3.0, 8.0, 3.0, 6, (True, True, False)),
    "blockwise": Traffic(10.0, 8.0, 10.0, 17),
}


def _gemm_ms(m: int, k: int, n: int, fp8: bool, dev: DeviceSpec, eff: Efficiency) -> float:
    """One (M, K) @ (K, N) gemm with a bf16 output: compute or memory bound."""
    flops = 2 * m * k * n
    rate = dev.fp8_tflops * eff.fp8_gemm if fp8 else dev.bf16_tflops * eff.bf16_gemm
    operand = 1 if fp8 else 2
    nbytes = operand * (m * k + k * n) + 2 * m * n
    return max(flops / (rate * 1e9), nbytes / (dev.hbm_tbps * eff.hbm * 1e9))


def _gemms_ms(m, k, n, fp8_gemms, dev, eff) -> float:
    # output (M,K)@(K,N), grad_input (M,N)@(N,K), grad_weight (N,M)@(M,K)
    dims = ((m, k, n), (m, n, k), (n, m, k))
    return sum(_gemm_ms(*d, fp8, dev, eff) for d, fp8 in zip(dims, fp8_gemms, strict=True))


# a GPU name as torch reports it ("NVIDIA H100 80GB HBM3") -> DEVICES' key; PCIe and NVL
# boards have other peaks than the SXM ones in DEVICES, GH200 / GB200 other GPUs
_GPU_NAME = re.compile(r"\b(H100|H200|B200)\b(?!.*\b(PCIE|NVL)\b)", re.IGNORECASE)


def device_spec(device: str | DeviceSpec | torch.device) -> DeviceSpec:
    """The ``DeviceSpec`` of ``device``: a ``DeviceSpec``, a key of ``DEVICES`` (``"h100"``,
    ``"h200"``, ``"b200"``), or a CUDA ``torch.device`` (its name, as torch reports it on
    this machine, looked up)."""
    if isinstance(device, DeviceSpec):
        return device
    if isinstance(device, torch.device):
        return _spec_of_torch_device(device)
    if not isinstance(device, str):
        raise ValueError(
            f"roofline: device={device!r} must be a GPU name (one of {sorted(DEVICES)}), a "
            "DeviceSpec or a CUDA torch.device"
        )
    try:
        return DEVICES[device.lower()]
    except KeyError:
        raise ValueError(
            f"roofline: no device {device!r}; known: {sorted(DEVICES)} (or pass a DeviceSpec)"
        ) from None


def _spec_of_torch_device(device: torch.device) -> DeviceSpec:
    names = f"its name (one of {sorted(DEVICES)}) or a DeviceSpec"
    if device.type != "cuda":
        raise ValueError(
            f"roofline: device={device!r} is not a GPU; the model predicts the time on the GPU "
            f"the run trains on: pass {names}"
        )
    name = cuda_device_name(device.index)
    if name is None:
        raise ValueError(
            f"roofline: device={device!r}, but this machine has no CUDA to look up the GPU's "
            f"name: pass {names}"
        )
    match = _GPU_NAME.search(name)
    if match is None:
        raise ValueError(
            f"roofline: device={device!r} is a {name!r}, which has no datasheet entry "
            f"(known: {', '.join(d.name for d in DEVICES.values())}): pass a DeviceSpec with "
            "its peaks"
        )
    return DEVICES[match.group(1).lower()]


def traffic_for(recipe: str) -> Traffic:
    try:
        return TRAFFIC[recipe]
    except KeyError:
        raise ValueError(
            f"roofline: no traffic model for recipe {recipe!r}; known: {sorted(TRAFFIC)}"
        ) from None


def predict(
    m: int,
    k: int,
    n: int,
    recipe: str = "tensorwise",
    device: str | DeviceSpec = "h100",
    efficiency: Efficiency | None = None,
) -> dict:
    """Predicted fwd+bwd times (ms) and float8 speedup of an (M, K) x (K, N) Linear.

    Args:
        m: tokens (the input's leading dims flattened); k: in_features; n: out_features.
        recipe: a float8kit recipe name (``TRAFFIC``'s keys).
        device: ``"h100"``, ``"h200"``, ``"b200"``, a ``DeviceSpec`` or a CUDA
            ``torch.device`` (``device_spec``).
        efficiency: achieved fractions of the peaks (default ``Efficiency()``).

    Returns:
        ``{"bf16_ms", "float8_ms", "gemm_ms", "traffic_ms", "traffic_bytes", "speedup"}``.
    """
    dev, eff, tr = device_spec(device), efficiency or Efficiency(), traffic_for(recipe)
    bf16_ms = _gemms_ms(m, k, n, (False, False, False), dev, eff)
    gemm_ms = _gemms_ms(m, k, n, tr.fp8_gemms, dev, eff)
    nbytes = tr.bytes(m, k, n)
    traffic_ms = nbytes / (dev.hbm_tbps * eff.hbm * 1e9) + tr.kernels * eff.kernel_us / 1e3
    float8_ms = gemm_ms + traffic_ms
    return {
        "bf16_ms": bf16_ms,
        "float8_ms": float8_ms,
        "gemm_ms": gemm_ms,
        "traffic_ms": traffic_ms,
        "traffic_bytes": nbytes,
        "speedup": bf16_ms / float8_ms,
    }


def predicted_speedup(
    m: int, k: int, n: int, recipe: str = "tensorwise", device="h100", efficiency=None
) -> float:
    """``predict(...)["speedup"]``."""
    return predict(m, k, n, recipe, device, efficiency)["speedup"]


# ----------------------------------------------------------------------------
# calibration from a GPU measurement


def calibrate(
    rows: Iterable[dict], device: str | DeviceSpec, recipe: str = "tensorwise"
) -> Efficiency:
    """Efficiencies that make the model reproduce measured fwd+bwd times.

    Args:
        rows: ``benchmarks/bench_linear.py`` JSON rows (``M, K, N, mode, recipe, bf16_ms,
            float8kit_ms``, ``compiled``) measured on ``device``; the fwd_bwd rows of
            ``recipe`` are used, only the compiled ones where there are any.
        device: the device they were measured on.
        recipe: whose float8 rows calibrate the fp8 rate.

    The bf16 gemm efficiency is the median over rows of the achieved bf16 rate over the
    peak; the fp8 one, of the rate left for the fp8 gemms once the modeled traffic time
    (at the default bandwidth efficiency) is taken out. Only compute-bound rows (at least
    1 GFLOP per gemm) count: small shapes measure launch costs, not rates.
    """
    dev, tr, base = device_spec(device), traffic_for(recipe), Efficiency()
    rows = list(rows)
    if any(r.get("compiled") for r in rows):  # the traffic model is the compiled graph's
        rows = [r for r in rows if r.get("compiled")]
    bf16, fp8 = [], []
    for r in rows:
        if r.get("mode") != "fwd_bwd" or r.get("recipe") != recipe:
            continue
        m, k, n = r["M"], r["K"], r["N"]
        flops = 2 * m * k * n
        if flops < 1e9 or not r.get("bf16_ms") or not r.get("float8kit_ms"):
            continue
        bf16.append(3 * flops / (r["bf16_ms"] * 1e9) / dev.bf16_tflops)
        traffic_ms = tr.bytes(m, k, n) / (dev.hbm_tbps * base.hbm * 1e9)
        gemm_ms = r["float8kit_ms"] - traffic_ms
        if gemm_ms > 0:
            fp8.append(sum(tr.fp8_gemms) * flops / (gemm_ms * 1e9) / dev.fp8_tflops)
    if not bf16 or not fp8:
        raise ValueError(
            f"calibrate: no compute-bound fwd_bwd rows of recipe {recipe!r} with bf16_ms and "
            "float8kit_ms (run benchmarks/bench_linear.py on the GPU with shapes >= 1 GFLOP)"
        )
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return dataclasses.replace(base, bf16_gemm=min(1.0, med(bf16)), fp8_gemm=min(1.0, med(fp8)))


# ----------------------------------------------------------------------------
# the filter


def auto_module_filter(
    recipe: str = "tensorwise",
    *,
    device: str | DeviceSpec | torch.device = "h100",
    tokens: int,
    min_speedup: float = 1.0,
    efficiency: Efficiency | None = None,
) -> Callable[[nn.Module, str], bool]:
    """A ``module_filter_fn`` that converts a Linear only where float8 is predicted to win.

    Args:
        recipe: the float8kit recipe the model is converted with.
        device: the GPU it trains on (``DEVICES``' keys, a ``DeviceSpec``, or a CUDA
            ``torch.device``, whose name is looked up on this machine).
        tokens: tokens per step on one device (batch * sequence length): a layer's M; a
            positive int.
        min_speedup: convert where the predicted fwd+bwd speedup is at least this (> 0).
        efficiency: calibrated efficiencies (default ``Efficiency()``).

    Returns:
        ``fn(module, fqn) -> bool``: True for an ``nn.Linear`` whose dims the float8 kernel
        takes (``default_module_filter``: multiples of 16, of 128 for blockwise) and whose
        ``predict(tokens, in_features, out_features, ...)`` speedup is >= ``min_speedup``.
    """
    from float8kit.config import Float8LinearConfig
    from float8kit.convert import default_module_filter

    # every argument is checked here: a NaN compares false with everything, so a NaN
    # tokens or min_speedup would otherwise keep every layer in hp without a word
    integral = isinstance(tokens, numbers.Integral) or (
        isinstance(tokens, float) and math.isfinite(tokens) and tokens.is_integer()
    )
    if isinstance(tokens, bool) or not integral or tokens <= 0:
        raise ValueError(
            f"auto_module_filter: tokens={tokens!r} must be a positive int: the tokens per "
            "step on one device (batch * seq_len)"
        )
    if (
        isinstance(min_speedup, bool)
        or not isinstance(min_speedup, numbers.Real)
        or not math.isfinite(min_speedup)
        or min_speedup <= 0
    ):
        raise ValueError(
            f"auto_module_filter: min_speedup={min_speedup!r} must be a finite number > 0 "
            "(1.0: wherever float8 is predicted faster)"
        )
    if efficiency is not None and not isinstance(efficiency, Efficiency):
        raise ValueError(
            f"auto_module_filter: efficiency={efficiency!r} must be a roofline.Efficiency "
            "(roofline.calibrate(rows, device) makes one) or None"
        )
    if not isinstance(recipe, str):
        raise ValueError(f"auto_module_filter: recipe={recipe!r} must be a recipe name (str)")
    traffic_for(recipe)  # an unknown recipe fails here, not at the first layer
    tokens = int(tokens)
    dev = device_spec(device)
    config = Float8LinearConfig.from_recipe_name(recipe) if recipe != "static" else None

    def keep_float8(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or not default_module_filter(module, fqn, config):
            return False
        s = predicted_speedup(
            tokens, module.in_features, module.out_features, recipe, dev, efficiency
        )
        return s >= min_speedup

    return keep_float8
