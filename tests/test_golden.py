"""A refactor changes no bits: the eager recipe cases of tools/golden.py (every named recipe
and STATIC, fp32 and bf16, autocast, experts: outputs, gradients, state_dicts over three
steps) hash exactly as recorded before the restructurings: tools/golden_hashes.json (AMD
EPYC, before 0.4's) or tools/golden_hashes_intel.json (Intel Xeon with AMX, before 0.5's),
whichever was recorded on this kind of machine. The hashes depend on the CPU's kernels and
the torch version: on another machine or torch the test says so and skips; `python
tools/golden.py --check tools/golden_hashes_intel.json` runs every case (FSDP2, TP, qgZ and
compiled ones too)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from float8kit.versions import cpu_has_native_bf16

REPO = Path(__file__).resolve().parents[1]
RECORDINGS = sorted((REPO / "tools").glob("golden_hashes*.json"))
sys.path.insert(0, str(REPO / "tools"))
import golden  # noqa: E402

# what the kernels' rounding depends on (not the OS build)
KEYS = ("torch", "cpu_avx512_bf16", "cpu_capability", "machine", "cpu_vendor")
# tools/golden_hashes.json was recorded on an AMD EPYC before the vendor was recorded
VENDOR_BEFORE_IT_WAS_RECORDED = "AuthenticAMD"


def _matches(recorded_env: dict, env: dict) -> bool:
    recorded_env = {"cpu_vendor": VENDOR_BEFORE_IT_WAS_RECORDED, **recorded_env}
    # oneDNN capped below AVX512-BF16 (ONEDNN_MAX_CPU_ISA) runs other bf16 kernels
    native_bf16 = cpu_has_native_bf16() == recorded_env["cpu_avx512_bf16"]
    return native_bf16 and all(env.get(k) == recorded_env[k] for k in KEYS)


def test_recordings_name_distinct_machines():
    envs = [json.loads(p.read_text())["env"] for p in RECORDINGS]
    assert len(envs) == 2
    keys = [
        tuple({"cpu_vendor": VENDOR_BEFORE_IT_WAS_RECORDED, **e}[k] for k in KEYS) for e in envs
    ]
    assert len(set(keys)) == len(keys)


def test_eager_cases_hash_as_recorded():
    env = golden.environment()
    found = [p for p in RECORDINGS if _matches(json.loads(p.read_text())["env"], env)]
    if not found:
        pytest.skip(
            f"hashes recorded on {[json.loads(p.read_text())['env'] for p in RECORDINGS]}, "
            f"this is {env}, native bf16 {cpu_has_native_bf16()}"
        )
    (GOLDEN,) = found
    run = subprocess.run(
        [sys.executable, "tools/golden.py", "--check", str(GOLDEN), "--only", "/eager"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout
    assert "570 hashes, 570 equal" in run.stdout
