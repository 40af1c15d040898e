"""Which hp dtype this CPU runs well: a bf16 and an fp32 matmul timed in one process, the two
interleaved (each pair of calls under the same load), and the dtype float8kit picks for CPU
runs (``float8kit.versions.cpu_hp_dtype``). Run it with oneDNN capped at AVX2
(``AVX2_ONLY``) to see what an AVX2-only CPU does: its bf16 matmul is emulated there.

    python benchmarks/measures/cpu_dtype.py   # prints one JSON line
"""

import json
import statistics
import time

import torch

from float8kit.versions import cpu_has_native_bf16, cpu_hp_dtype

# An AVX2-only CPU (no AVX512-BF16, no AMX: many cloud VMs and laptops), emulated on one that
# has them: oneDNN (the matmuls) and ATen (the elementwise kernels) capped at AVX2, so bf16
# matmuls are emulated and float8kit.versions.cpu_hp_dtype() picks fp32, as on such a CPU.
# Give such a process a fresh TORCHINDUCTOR_CACHE_DIR: torch 2.13 reuses kernels its cache
# holds for the uncapped ISA, and they crash.
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
SHAPE = (2048, 256, 1024)  # M, K, N


def matmul_ms(pairs: int = 5, shape: tuple[int, int, int] = SHAPE) -> dict:
    """Median ms of a bf16 and of an fp32 ``M x K @ K x N`` on one thread, interleaved."""
    m, k, n = shape
    own = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(m, k), torch.randn(k, n)
    operands = {dt: (a.to(dt), b.to(dt)) for dt in (torch.bfloat16, torch.float32)}
    times = {dt: [] for dt in operands}
    try:
        for i in range(pairs + 1):
            for dt, (x, y) in operands.items():
                t0 = time.perf_counter()
                x @ y
                if i:  # the first pair warms up
                    times[dt].append(1e3 * (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(own)
    bf16, fp32 = (statistics.median(times[dt]) for dt in operands)
    return {
        "shape_mkn": list(shape),
        "bf16_ms": round(bf16, 2),
        "fp32_ms": round(fp32, 2),
        "bf16_over_fp32": round(bf16 / fp32, 2),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": cpu_has_native_bf16(),
        "hp_dtype": str(cpu_hp_dtype()).removeprefix("torch."),
    }


if __name__ == "__main__":
    print(json.dumps(matmul_ms()))
