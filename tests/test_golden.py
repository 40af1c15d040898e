"""A refactor changes no bits: the eager recipe cases of tools/golden.py (every named recipe
and STATIC, fp32 and bf16, autocast, experts: outputs, gradients, state_dicts over three
steps) hash exactly as recorded in tools/golden_hashes.json before the 0.4 restructuring.
The hashes depend on the CPU's kernels and the torch version: on another machine or torch
the test says so and skips; `python tools/golden.py --check tools/golden_hashes.json` runs
every case (FSDP2, TP, qgZ and compiled ones too)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from float8kit.versions import cpu_has_native_bf16

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tools" / "golden_hashes.json"
sys.path.insert(0, str(REPO / "tools"))
import golden  # noqa: E402


def test_eager_cases_hash_as_recorded():
    recorded = json.loads(GOLDEN.read_text())
    env = golden.environment()
    # what the kernels' rounding depends on (not the OS build)
    keys = ("torch", "cpu_avx512_bf16", "cpu_capability", "machine")
    # oneDNN capped below AVX512-BF16 (ONEDNN_MAX_CPU_ISA) runs other bf16 kernels
    native_bf16 = cpu_has_native_bf16() == recorded["env"]["cpu_avx512_bf16"]
    if any(env.get(k) != recorded["env"][k] for k in keys) or not native_bf16:
        pytest.skip(
            f"hashes recorded on {recorded['env']}, this is {env}, native bf16 "
            f"{cpu_has_native_bf16()}"
        )
    run = subprocess.run(
        [sys.executable, "tools/golden.py", "--check", str(GOLDEN), "--only", "/eager"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout
    assert "570 hashes, 570 equal" in run.stdout
