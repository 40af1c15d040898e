"""float8kit.integrations.lightning: Float8LightningCallback in real Lightning Trainers:
one process, and ModelParallelStrategy (FSDP2 in configure_model) on 2 gloo processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import lightning_model as lm  # noqa: E402  (tests/lightning_model.py)

from float8kit import Float8Linear  # noqa: E402
from float8kit.integrations.lightning import Float8LightningCallback  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _mean(xs):
    return sum(xs) / len(xs)


def test_converts_in_setup_and_precomputes_once_per_optimizer_step():
    cb = Float8LightningCallback(module_filter_fn=lm.filter_head)
    model = lm.Regressor()
    trainer = lm.fit(model, 3, [cb], devices=1)
    assert cb.converted == ["blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"]
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 4
    # 3 optimizer steps of 2 micro-batches: 6 training steps, 3 precomputes.
    assert len(model.losses) == 6 and trainer.global_step == 3
    assert cb.precompute_calls == 3
    assert cb._handles == []  # the post-step hooks are removed at the end of fit


def test_float8_trains_like_bf16_one_process():
    bf16 = lm.Regressor()
    lm.fit(bf16, 30, devices=1)
    fp8 = lm.Regressor()
    lm.fit(fp8, 30, [Float8LightningCallback(module_filter_fn=lm.filter_head)], devices=1)
    assert _mean(bf16.losses[-10:]) < 0.8 * _mean(bf16.losses[:10])  # it learns
    gap = abs(_mean(fp8.losses[-10:]) - _mean(bf16.losses[-10:])) / _mean(bf16.losses[-10:])
    assert gap < 0.02, gap


def test_a_low_bit_optimizer_from_configure_optimizers():
    """AdamW8bit returned by configure_optimizers (after the callback converted): 30 float8
    steps, the last 10 losses within 2% of torch's AdamW; precompute follows its steps."""
    from float8kit.optim import AdamW8bit

    runs = {}
    for name, optimizer in (("adamw", None), ("adamw8bit", AdamW8bit)):
        model = lm.Regressor(**({"optimizer": optimizer} if optimizer else {}))
        cb = Float8LightningCallback(module_filter_fn=lm.filter_head)
        trainer = lm.fit(model, 30, [cb], devices=1)
        runs[name] = model.losses
    ref, got = _mean(runs["adamw"][-10:]), _mean(runs["adamw8bit"][-10:])
    assert abs(got - ref) / ref < 0.02, (ref, got)
    assert isinstance(trainer.optimizers[0], AdamW8bit) and cb.precompute_calls == 30


@pytest.mark.slow
def test_model_parallel_strategy_two_ranks_float8_all_gather(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + ["tests/lightning_model.py"],
        cwd=REPO,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
            "FLOAT8KIT_RESULTS": str(tmp_path),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert sorted(x["rank"] for x in ranks) == [0, 1]
    for x in ranks:
        f8, ag, bf16 = x["float8"], x["float8_all_gather"], x["bf16"]
        assert (
            f8["converted"]
            == ag["converted"]
            == ["blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"]
        )
        assert ag["local_types"] == ["Float8AllGatherWeight"] * 4  # sharded in float8
        assert f8["precompute_calls"] == ag["precompute_calls"] == 4
        # float8 all-gather moves other bytes, same math: bitwise the hp all-gather run.
        assert ag["losses"] == f8["losses"]
        assert len(f8["losses"]) == 8
        gap = abs(_mean(f8["losses"]) - _mean(bf16["losses"])) / _mean(bf16["losses"])
        assert gap < 0.02, gap
