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


@pytest.mark.parametrize("cap", ["AVX2", "avx512_core"])
def test_onednn_capped_below_bf16_means_fp32(cap):
    """ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16 makes oneDNN emulate bf16 matmuls (tools/
    measure.py cpu_dtype measures it): CPU runs then compute in fp32, as on an AVX2-only CPU."""
    assert probe(ONEDNN_MAX_CPU_ISA=cap) == "False torch.float32"


@pytest.mark.parametrize("cap", ["AVX512_CORE_BF16", "ALL", "DEFAULT"])
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


# ---------------------------------------------------------------------------- MX kernels

SM90_ERROR = (
    "float8kit: the mxfp8 recipe's MX gemms need an sm100 (Blackwell) GPU, CUDA capability "
    ">= 10.0; NVIDIA H200 (cuda:0) is sm90. Use a float8 recipe (tensorwise, rowwise) on this "
    "GPU, or Float8LinearConfig(emulate=True) to emulate MX in fp32"
)


@pytest.mark.parametrize(
    "capability, runs", [((8, 9), False), ((9, 0), False), ((10, 0), True), ((12, 0), True)]
)
def test_mx_kernels_need_capability_10(pretend_gpu, capability, runs):
    pretend_gpu(capability)
    assert versions.mx_kernels_supported(0) is runs
    assert versions.mx_kernels_supported() is runs  # the current device


def test_mx_probe_asks_each_device_once(pretend_gpu, monkeypatch):
    pretend_gpu((9, 0))
    asked = []

    def capability(index=None):
        asked.append(index)
        return (9, 0) if index == 0 else (10, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    answers = [versions.mx_kernels_supported(i) for i in (0, 1, 0, 1, None)]
    assert answers == [False, True, False, True, False]
    assert asked == [0, 1]


def test_sm90_error_names_the_recipe_the_gpu_and_the_fix(pretend_gpu):
    pretend_gpu((9, 0))
    with pytest.raises(RuntimeError) as e:
        versions.require_mx_kernels(
            torch.device("cuda"), "Float8LinearConfig", "tensorwise, rowwise"
        )
    assert str(e.value) == SM90_ERROR
    pretend_gpu((10, 0))
    assert versions.require_mx_kernels(torch.device("cuda", 0), "Float8LinearConfig", "") is None


def test_no_gpu_to_ask_refuses_nothing(monkeypatch):
    # a CUDA build of torch without a GPU (the fake-CUDA lane) traces the MX call sites
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert versions.mx_kernels_supported(0) is True
    assert versions.require_mx_kernels(torch.device("cuda", 0), "Float8LinearConfig", "") is None


def test_mx_check_is_a_constant_to_compile(monkeypatch):
    # fullgraph: no graph break; the probe runs once, while dynamo traces, never per call
    asked = []

    def capability(index):
        asked.append(index)
        return (10, 0)

    monkeypatch.setattr(versions, "_cuda_capability", capability)

    def step(x):
        versions.require_mx_kernels(torch.device("cuda", 0), "Float8LinearConfig", "")
        return x * 2

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    x = torch.arange(4.0)
    for _ in range(3):
        assert torch.equal(compiled(x), x * 2)
    assert asked == [0]
