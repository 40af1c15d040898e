"""float8kit.integrations.hf: Float8Callback in real HF trainers (tiny Llama, CPU): plain
``Trainer`` and TRL's ``SFTTrainer`` in one process, and ``Trainer`` with FSDP2 through
accelerate on 2 gloo processes with float8 all-gather."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import hf_model as hm  # noqa: E402  (tests/hf_model.py)
from transformers import LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from float8kit import Float8Linear, Float8LinearConfig  # noqa: E402
from float8kit.integrations.hf import Float8Callback  # noqa: E402
from tests.helpers import count_scaled_mm  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
_model, _losses = hm.llama, hm.losses


def _trainer(tmp_path, steps: int, callbacks=(), model=None, optimizers=(None, None), **overrides):
    args = TrainingArguments(**hm.training_kwargs(tmp_path / "out", steps, **overrides))
    return Trainer(
        model=model or _model(),
        args=args,
        train_dataset=hm.Tokens(16 * steps),
        callbacks=list(callbacks),
        optimizers=optimizers,
    )


def test_converts_at_init_and_precomputes_once_per_optimizer_step(tmp_path, caplog):
    cb = Float8Callback()
    with caplog.at_level(logging.INFO, logger="float8kit.integrations.hf"):
        trainer = _trainer(tmp_path, steps=3, callbacks=[cb])
    model = trainer.model
    # 2 layers x (q, k, v, o, gate, up, down) in float8; lm_head stays hp.
    assert len(cb.converted) == 14
    assert sorted(cb.converted) == sorted(
        fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)
    )
    assert not isinstance(model.lm_head, Float8Linear)
    logged = [r.getMessage() for r in caplog.records if "float8kit" in r.getMessage()]
    assert logged == [
        "float8kit: 14 of 15 Linear layers run in float8 (14 converted now), 1 kept in hp"
    ]
    with caplog.at_level(logging.INFO, logger="float8kit.integrations.hf"):
        trainer.train()
    logged = [r.getMessage() for r in caplog.records if "float8kit" in r.getMessage()]
    assert len(logged) == 1  # no FSDP asked for: no word about sharding at on_train_begin
    # 3 optimizer steps of 2 micro-batches each: one precompute per optimizer step.
    assert trainer.state.global_step == 3
    assert cb.precompute_calls == 3


def _check_trains_like_bf16_and_saves_plain(bf16, fp8, cb, tmp_path):
    """30 steps: float8 learns, its last 10 losses within 2% of bf16's, one precompute per
    step; save_model -> from_pretrained into a plain model: every tensor bitwise."""
    ref, got = _losses(bf16), _losses(fp8)
    assert len(ref) == len(got) == 30
    assert ref[-1] < 0.5 * ref[0]  # it learns
    mean_ref, mean_got = sum(ref[-10:]) / 10, sum(got[-10:]) / 10
    assert abs(mean_got - mean_ref) / mean_ref < 0.02, (mean_ref, mean_got)
    assert cb.precompute_calls == 30

    fp8.save_model(str(tmp_path / "saved"))
    plain = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert not any(isinstance(m, Float8Linear) for m in plain.modules())
    ours, theirs = fp8.model.state_dict(), plain.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


def test_float8_trains_like_bf16_and_saves_a_plain_checkpoint(tmp_path):
    bf16 = _trainer(tmp_path / "bf16", steps=30)
    bf16.train()
    cb = Float8Callback()
    fp8 = _trainer(tmp_path / "fp8", steps=30, callbacks=[cb])
    fp8.train()
    _check_trains_like_bf16_and_saves_plain(bf16, fp8, cb, tmp_path)


def test_delayed_trainer_checkpoints_and_resumes_bitwise(tmp_path):
    """The delayed recipe (q/k/v and gate/up share their input casts, state.Tie) through
    Trainer's own checkpoints (save_pretrained: safetensors) and resume_from_checkpoint: the
    resumed run's losses and final state, float8 state included, are bitwise those of the
    run that was not interrupted; the plain model loads the checkpoint's parameters."""
    from safetensors.torch import load_file

    delayed = Float8LinearConfig.from_recipe_name("delayed")

    def run(out, resume=None):
        cb = Float8Callback(delayed)
        trainer = _trainer(out, 4, [cb], save_strategy="steps", save_steps=2)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    ckpt = tmp_path / "full" / "out" / "checkpoint-2"
    saved = load_file(ckpt / "model.safetensors")
    assert "model.layers.0.self_attn.k_proj.fp8_amax_history_input" in saved
    resumed = run(tmp_path / "resumed", resume=str(ckpt))

    def later(trainer):
        return [h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > 2]

    assert len(later(full)) == 2 and later(resumed) == later(full)
    ours, theirs = full.model.state_dict(), resumed.model.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    attn = resumed.model.model.layers[0].self_attn
    assert attn.q_proj.fp8_state.tie is attn.k_proj.fp8_state.tie is not None  # shared again

    plain = LlamaForCausalLM.from_pretrained(str(ckpt))  # the float8 keys: unexpected, ignored
    for k, v in plain.state_dict().items():
        assert torch.equal(v, saved[k]), k


def test_a_low_bit_optimizer_in_one_argument(tmp_path):
    """Trainer(optimizer_cls_and_kwargs=(AdamW8bit, {...})): Trainer builds it after the
    callback converted (with float8 all-gather, whose conversion replaces the weights: a
    passed optimizer is refused); 20 steps, the last 5 losses within 2% of torch's AdamW,
    its states block-quantized."""
    from float8kit.optim import AdamW8bit

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    runs = {}
    for name, cls in (("adamw", torch.optim.AdamW), ("adamw8bit", AdamW8bit)):
        args = TrainingArguments(**hm.training_kwargs(tmp_path / name, 20))
        trainer = Trainer(
            model=_model(),
            args=args,
            train_dataset=hm.Tokens(16 * 20),
            callbacks=[Float8Callback(config)],
            optimizer_cls_and_kwargs=(cls, {"lr": args.learning_rate}),
        )
        trainer.train()
        runs[name] = (_losses(trainer), trainer.optimizer)
    ref, got = (sum(runs[k][0][-5:]) / 5 for k in ("adamw", "adamw8bit"))
    assert abs(got - ref) / ref < 0.02, (ref, got)
    opt = runs["adamw8bit"][1]
    opt = getattr(opt, "optimizer", opt)  # accelerate's wrapper
    assert isinstance(opt, AdamW8bit)
    assert any(s["exp_avg"].dtype == torch.uint8 for s in opt.state.values())


def test_refuses_an_optimizer_it_would_orphan(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    cb = Float8Callback(Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    with pytest.raises(ValueError, match="optimizers=.*Let Trainer create the optimizer"):
        _trainer(tmp_path, steps=1, callbacks=[cb], model=model, optimizers=(opt, None))
    # Without float8 all-gather the parameters stay the same objects: a passed optimizer is
    # fine, and it holds exactly the model's parameters.
    cb = Float8Callback()
    trainer = _trainer(tmp_path, steps=1, callbacks=[cb], model=model, optimizers=(opt, None))
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in trainer.model.parameters()}
    assert len(cb.converted) == 14


def test_refuses_accelerate_fp8(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ValueError, match="accelerate's own fp8 is on"):
        _trainer(tmp_path, steps=1, callbacks=[Float8Callback()], bf16=False)


def test_importing_float8kit_imports_no_trainer():
    import subprocess
    import sys

    names = ("transformers", "accelerate", "float8kit.integrations")
    code = f"import sys, float8kit; print(sorted(m for m in {names} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------ TRL SFTTrainer


def _sft(tmp_path, steps: int, callbacks=()):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    # sequential: the same batches as _trainer(..., train_sampling_strategy="sequential")
    args = SFTConfig(
        **hm.training_kwargs(
            tmp_path / "out", steps, train_sampling_strategy="sequential", max_length=None
        )
    )
    return SFTTrainer(
        model=_model(),
        args=args,
        train_dataset=Dataset.from_dict(hm.token_lists(16 * steps)),
        processing_class=hm.tokenizer(),
        callbacks=list(callbacks),
    )


def test_sft_trainer_converts_and_precomputes_once_per_optimizer_step(tmp_path):
    pytest.importorskip("trl")
    cb = Float8Callback()
    sft = _sft(tmp_path / "sft", 3, [cb])
    assert len(cb.converted) == 14 and not isinstance(sft.model.lm_head, Float8Linear)
    # SFTTrainer turns gradient checkpointing on and computes the loss with its own fused
    # LM head (reading lm_head.weight, which stays hp): float8 runs under both.
    assert sft.args.gradient_checkpointing
    with count_scaled_mm() as sft_gemms:
        sft.train()
    assert sft.state.global_step == 3 and cb.precompute_calls == 3

    plain_cb = Float8Callback()
    plain = _trainer(tmp_path / "plain", 3, [plain_cb], train_sampling_strategy="sequential")
    with count_scaled_mm() as plain_gemms:
        plain.train()
    # 6 micro-batches x 14 layers: 3 float8 gemms each (output, grad_input, grad_weight),
    # and under SFT's checkpointing the forward gemm once more, recomputed for backward.
    assert len(plain_gemms) == 6 * 14 * 3
    assert len(sft_gemms) == 6 * 14 * 4
    # Same weights, batches and float8 layers; only the loss head differs (SFT's chunked
    # log-probs vs the model's cross-entropy): measured within 0.05%.
    ref, got = _losses(plain), _losses(sft)
    assert len(ref) == len(got) == 3
    for r, g in zip(ref, got, strict=True):
        assert abs(g - r) / r < 2e-3, (ref, got)


def test_sft_float8_trains_like_bf16_and_saves_a_plain_checkpoint(tmp_path):
    pytest.importorskip("trl")
    bf16 = _sft(tmp_path / "bf16", 30)
    bf16.train()
    cb = Float8Callback()
    fp8 = _sft(tmp_path / "fp8", 30, [cb])
    fp8.train()
    _check_trains_like_bf16_and_saves_plain(bf16, fp8, cb, tmp_path)


# ------------------------------------------------------------ FSDP2 through accelerate


@pytest.fixture(scope="module")
def fsdp2_ranks(tmp_path_factory):
    """tests/hf_model.py under torchrun: 2 gloo ranks, Trainer(fsdp=True,
    fsdp_config={"version": 2}), Float8Callback with float8 all-gather, 3 steps (after 1
    step as accelerate runs it on CPU unshimmed)."""
    out = tmp_path_factory.mktemp("hf_fsdp2")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + ["tests/hf_model.py"],
        cwd=REPO,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
            "FLOAT8KIT_RESULTS": str(out),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    return ranks, torch.load(out / "params_step1.pt"), out


@pytest.mark.slow
def test_fsdp2_through_accelerate_shards_float8_weights(fsdp2_ranks):
    ranks, _, _ = fsdp2_ranks
    assert sorted(x["rank"] for x in ranks) == [0, 1]
    for x in ranks:
        # accelerate prepared the model with FSDP2 (not DDP, its CPU default)
        assert x["fsdp"] and x["distributed_type"] == "DistributedType.FSDP"
        assert x["model_type"] == "FSDPLlamaForCausalLM"
        assert len(x["converted"]) == 14
        # every float8 weight is sharded as float8kit's float8 all-gather weight
        assert x["weights"] == ["DTensor/Float8AllGatherWeight"] * 14
        # the optimizer holds each of the sharded model's parameters, once
        assert x["n_held"] == x["n_held_distinct_model_params"] == x["n_params"] == 21
        assert x["global_step"] == 3 and x["precompute_calls"] == 3
    assert ranks[0]["losses"] == ranks[1]["losses"]


@pytest.mark.slow
def test_fsdp_that_accelerate_dropped_is_warned_about(fsdp2_ranks):
    # The same Trainer without the CPU shim: accelerate 1.15 drops the FSDP plugin on gloo
    # CPU ranks and wraps the model in DDP; the callback says so, once, on every rank.
    ranks, _, _ = fsdp2_ranks
    for x in ranks:
        dropped = x["without_shim"]
        assert dropped["model_type"] == "DistributedDataParallel"
        assert len(dropped["warnings"]) == 1
        assert "accelerate did not shard the model" in dropped["warnings"][0]
        assert x["warnings"] == []  # sharded: nothing to say


@pytest.mark.slow
def test_fsdp2_through_accelerate_trains_like_one_process(fsdp2_ranks, tmp_path):
    ranks, fsdp_step1, _ = fsdp2_ranks
    # One process, same global batches (8 sequences per micro-batch, in order), float8.
    ref_step1 = hm.ParamsAfterFirstStep()
    ref = _trainer(tmp_path, 3, [ref_step1, Float8Callback()], train_sampling_strategy="sequential")
    ref.train()
    # FSDP2 computes the loss from bf16 logits (mp_policy param_dtype): its logged losses
    # are bf16 values (relative spacing 2^-7 above 4); measured within 0.2% of one process.
    for r, g in zip(_losses(ref), ranks[0]["losses"], strict=True):
        assert abs(g - r) / r < 0.01, (_losses(ref), ranks[0]["losses"])

    # AdamW's first step moves every element with a gradient by exactly lr (m/sqrt(v) is
    # +-1): a parameter the optimizer missed would not move, one stepped twice would move
    # 2 lr. Against one process: the same steps, except where bf16/float8 noise flips the
    # sign of a tiny gradient (measured at most 6% of a 64-element norm weight, 3% of a
    # matrix).
    init = dict(_model().named_parameters())
    assert fsdp_step1.keys() == ref_step1.params.keys() == init.keys()
    for name, got in fsdp_step1.items():
        want, p0 = ref_step1.params[name], init[name].detach()
        moved, moved_ref = (got - p0).abs(), (want - p0).abs()
        assert moved.max() <= hm.LR * (1 + 1e-3), name
        assert abs(moved.mean() / moved_ref.mean() - 1) < 0.01, name
        flipped = ((got - want).abs() > hm.LR).float().mean()
        assert flipped < 0.1, (name, flipped)


@pytest.mark.slow
def test_fsdp2_save_model_writes_a_plain_checkpoint(fsdp2_ranks):
    # save_model under FSDP2 (accelerate's full state dict) -> from_pretrained into a model
    # that never heard of float8kit: every tensor bitwise the gathered trained parameters.
    _, _, out = fsdp2_ranks
    trained = torch.load(out / "params_final.pt")
    plain = LlamaForCausalLM.from_pretrained(str(out / "saved"))
    assert not any(isinstance(m, Float8Linear) for m in plain.modules())
    loaded = dict(plain.named_parameters())
    assert loaded.keys() == trained.keys()
    for k, v in trained.items():
        assert torch.equal(loaded[k].detach(), v), k
    assert not torch.equal(  # trained weights, not the initial ones
        trained["model.layers.0.mlp.up_proj.weight"], _model().model.layers[0].mlp.up_proj.weight
    )
