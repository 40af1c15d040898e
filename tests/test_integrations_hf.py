"""float8kit.integrations.hf: Float8Callback in a real HF Trainer (tiny Llama, CPU)."""

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from float8kit import Float8Linear, Float8LinearConfig  # noqa: E402
from float8kit.integrations.hf import Float8Callback  # noqa: E402

VOCAB, SEQ = 128, 32


class _Tokens(torch.utils.data.Dataset):
    """Sequences that count up from a random start (mod VOCAB): learnable in a few steps."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(cfg)


def _trainer(tmp_path, steps: int, callbacks=(), model=None, optimizers=(None, None), **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        use_cpu=True,
        bf16=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    args = TrainingArguments(**kwargs)
    return Trainer(
        model=model or _model(),
        args=args,
        train_dataset=_Tokens(16 * steps),
        callbacks=list(callbacks),
        optimizers=optimizers,
    )


def _losses(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


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
    trainer.train()
    # 3 optimizer steps of 2 micro-batches each: one precompute per optimizer step.
    assert trainer.state.global_step == 3
    assert cb.precompute_calls == 3


def test_float8_trains_like_bf16_and_saves_a_plain_checkpoint(tmp_path):
    bf16 = _trainer(tmp_path / "bf16", steps=30)
    bf16.train()
    cb = Float8Callback()
    fp8 = _trainer(tmp_path / "fp8", steps=30, callbacks=[cb])
    fp8.train()
    ref, got = _losses(bf16), _losses(fp8)
    assert len(ref) == len(got) == 30
    assert ref[-1] < 0.5 * ref[0]  # it learns
    mean_ref, mean_got = sum(ref[-10:]) / 10, sum(got[-10:]) / 10
    assert abs(mean_got - mean_ref) / mean_ref < 0.02, (mean_ref, mean_got)
    assert cb.precompute_calls == 30

    # save_model -> from_pretrained into a plain model: every tensor bitwise.
    fp8.save_model(str(tmp_path / "saved"))
    plain = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert not any(isinstance(m, Float8Linear) for m in plain.modules())
    ours, theirs = fp8.model.state_dict(), plain.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


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
