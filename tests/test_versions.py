"""float8kit/versions.py's CPU probe: which hp dtype a CPU run computes in."""

import os
import subprocess
import sys

import pytest
import torch

from float8kit import versions

PROBE = (
    "from float8kit.versions import cpu_has_native_bf16, cpu_hp_dtype; "
    "print(cpu_has_native_bf16(), cpu_hp_dtype())"
)


IGNORED = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", versions.CPU_HP_DTYPE_ENV)


def probe(**env: str) -> str:
    """The probe's answer in a fresh process with ``env`` added (oneDNN reads its ISA cap once,
    at the first matmul)."""
    run = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**{k: v for k, v in os.environ.items() if k not in IGNORED}, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return run.stdout.strip()


def test_native_bf16_follows_the_cpu_flags():
    hardware = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    expected = "True torch.bfloat16" if hardware else "False torch.float32"
    assert probe() == expected


@pytest.mark.parametrize("cap", ["AVX2", "avx512_core", "AVX2_VNNI"])
def test_onednn_capped_below_bf16_means_fp32(cap):
    """ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16 makes oneDNN emulate bf16 matmuls (tools/
    measure.py cpu_dtype measures it): CPU runs then compute in fp32, as on an AVX2-only CPU."""
    assert probe(ONEDNN_MAX_CPU_ISA=cap) == "False torch.float32"


@pytest.mark.parametrize("cap", ["AVX512_CORE_BF16", "avx512_core_amx", "ALL"])
def test_onednn_capped_at_or_above_bf16_keeps_it(cap):
    if not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("this CPU has no native bf16")
    assert probe(ONEDNN_MAX_CPU_ISA=cap) == "True torch.bfloat16"


def test_the_override_wins_and_a_bad_one_names_the_variable(monkeypatch):
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        monkeypatch.setenv(versions.CPU_HP_DTYPE_ENV, name)
        assert versions.cpu_hp_dtype() is dtype
    monkeypatch.setenv(versions.CPU_HP_DTYPE_ENV, "fp16")
    with pytest.raises(ValueError, match="FLOAT8KIT_CPU_HP_DTYPE='fp16'.*bfloat16.*float32"):
        versions.cpu_hp_dtype()
