"""benchmarks/gpu_acceptance.sh --dry-run on CPU: every step's script exists, imports, and
accepts the flags the step passes; pytest steps name existing paths and declared markers."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_acceptance.sh"


def test_dry_run_checks_every_step(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path), "--dry-run"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert [(s["part"], s["step"]) for s in steps] == [
        (1, "linear_compiled"),
        (1, "roofline"),
        (1, "gpu_tests"),
        (1, "train"),
        (2, "linear_more"),
        (2, "memory"),
        (2, "precompute"),
        (2, "optim"),
        (2, "step_profile"),
        (2, "train_rowwise"),
    ]
    assert all(s["exit"] == 0 for s in steps), steps
    # each part's step limits fit one 10-minute device command with a minute to spare
    for part in (1, 2):
        assert sum(s["limit_s"] for s in steps if s["part"] == part) <= 9 * 60, part
    # and both parts one lease's 15 minutes of device time, a minute left for its start
    assert sum(s["limit_s"] for s in steps) <= 14 * 60
    summary = (tmp_path / "summary.md").read_text()
    assert "dry run" in summary and "| linear_compiled | 0 |" in summary
    # the timed shapes: the seed shape and the three Llama-3-8B ones, both timings
    cmd = steps[0]["command"]
    assert "4096x8192x16384,8192x4096x4096,8192x4096x14336,8192x14336x4096" in cmd
    assert "--timing back_to_back,synced" in cmd


def test_a_step_with_an_unknown_flag_fails_the_dry_run_of_its_part(tmp_path):
    # the same checker on a step whose flag the benchmark does not have; --part 1 runs
    # part 1's steps only, and every one of them although one failed
    bad = SCRIPT.read_text().replace("--modes fwd_bwd", "--modez fwd_bwd")
    copy = ROOT / "benchmarks" / f".gpu_acceptance_bad_{os.getpid()}.sh"
    copy.write_text(bad)
    try:
        env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
        run = subprocess.run(
            ["bash", str(copy), str(tmp_path), "--dry-run", "--part", "1"],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
    finally:
        copy.unlink()
    assert run.returncode != 0
    assert "has no flag --modez" in (tmp_path / "linear_compiled.log").read_text()
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert [s["step"] for s in steps] == ["linear_compiled", "roofline", "gpu_tests", "train"]
    assert steps[0]["exit"] != 0
