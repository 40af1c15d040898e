"""A tiny Llama, its data and training arguments for tests/test_integrations_hf.py; run under
torchrun it trains with FSDP2 through accelerate (``fsdp_config={"version": 2}``) and writes
each rank's results into the folder $FLOAT8KIT_RESULTS (JSON; rank 0's full parameters after
the first and the last optimizer step as torch files; the checkpoint ``save_model`` wrote)."""

import json
import logging
import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from float8kit import Float8Linear, Float8LinearConfig
from float8kit.integrations.hf import Float8Callback

VOCAB, SEQ = 128, 32
LR = 3e-3


class Tokens(torch.utils.data.Dataset):
    """Sequences that count up from a random start (mod VOCAB): learnable in a few steps."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def token_lists(n: int) -> dict[str, list[list[int]]]:
    """``Tokens(n)``'s sequences as a column of token-id lists (``datasets.Dataset.from_dict``)."""
    return {"input_ids": Tokens(n).ids.tolist()}


def tokenizer():
    """A word-level tokenizer over the VOCAB ids ("t0" ... "t127"), built offline: TRL's
    ``SFTTrainer`` wants one (its pad and eos ids), and the data comes tokenized."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    return PreTrainedTokenizerFast(
        tokenizer_object=words, eos_token="t0", pad_token="t0", unk_token="t0"
    )


def llama() -> LlamaForCausalLM:
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


def training_kwargs(out_dir, steps: int, **overrides) -> dict:
    kwargs = dict(
        output_dir=str(out_dir),
        max_steps=steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=LR,
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
    return kwargs


def losses(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


class ParamsAfterFirstStep(TrainerCallback):
    """Keeps every parameter's full value right after the first optimizer step (before the
    callbacks after it: add it before ``Float8Callback``, whose precompute reads only)."""

    def __init__(self):
        self.params: dict[str, torch.Tensor] = {}

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:  # the counter moves after this event
            for name, p in model.named_parameters():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                full = getattr(full, "_tensor", full)  # a float8 all-gather weight's hp tensor
                self.params[name] = full.detach().float().clone()
        return control


# ------------------------------------------------------------------------ FSDP2 on CPU


def enable_accelerate_fsdp_on_cpu():
    """accelerate 1.15 turns a ``fsdp_plugin`` into FSDP only for accelerator devices
    (``AcceleratorState.__init__`` switches MULTI_GPU, MULTI_XPU, ... to ``FSDP``, not
    MULTI_CPU): on gloo CPU ranks it drops the plugin and ``Trainer`` trains with DDP. This
    does for MULTI_CPU what accelerate does for those devices; everything
    after (``fsdp2_prepare_model``, the optimizer's re-mapping, ``Trainer``'s FSDP paths) is
    accelerate's and transformers' own code."""
    import accelerate.state
    from accelerate.utils import DistributedType

    init = accelerate.state.AcceleratorState.__init__

    def fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            accelerate.state.PartialState._shared_state["distributed_type"] = self.distributed_type

    accelerate.state.AcceleratorState.__init__ = fsdp_on_cpu


class Warnings(logging.Handler):
    """The messages ``Float8Callback`` logs at WARNING."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("float8kit.integrations.hf").addHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())


def fsdp_run(out_dir, steps: int, callbacks=()) -> tuple[Trainer, ParamsAfterFirstStep]:
    """``steps`` optimizer steps of 2 micro-batches of 4 sequences per rank, in order
    (sequential sampler): the same global batches as one process with 8 per micro-batch."""
    params = ParamsAfterFirstStep()
    args = TrainingArguments(
        **training_kwargs(
            out_dir,
            steps,
            per_device_train_batch_size=4,
            train_sampling_strategy="sequential",
            fsdp=True,
            fsdp_config={"version": 2},
            ddp_backend="gloo",
        )
    )
    trainer = Trainer(
        model=llama(),
        args=args,
        train_dataset=Tokens(16 * steps),
        callbacks=[params, *callbacks],
    )
    trainer.train()
    return trainer, params


def _sharded_weights(model) -> list[str]:
    return [
        f"{type(m.weight).__name__}/{type(getattr(m.weight, '_local_tensor', m.weight)).__name__}"
        for m in model.modules()
        if isinstance(m, Float8Linear)
    ]


if __name__ == "__main__":  # torchrun --nproc-per-node 2 tests/hf_model.py
    out = Path(os.environ["FLOAT8KIT_RESULTS"])
    rank = int(os.environ["RANK"])
    # As accelerate 1.15 has it on CPU: the FSDP plugin dropped, DDP, and the callback warns.
    warned = Warnings()
    ddp, _ = fsdp_run(out / f"ddp{rank}", 1, [Float8Callback()])
    ddp_result = {"model_type": type(ddp.model_wrapped).__name__, "warnings": warned.messages}
    enable_accelerate_fsdp_on_cpu()
    warned.messages = []
    cb = Float8Callback(Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    trainer, params = fsdp_run(out / f"out{rank}", 3, [cb])
    opt = trainer.optimizer
    held = [p for g in opt.param_groups for p in g["params"]]
    result = {
        "rank": rank,
        "fsdp": trainer.is_fsdp_enabled,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "model_type": type(trainer.model).__name__,
        "converted": cb.converted,
        "weights": _sharded_weights(trainer.model),
        "n_params": len(list(trainer.model.parameters())),
        "n_held": len(held),
        "n_held_distinct_model_params": len(
            {id(p) for p in held} & {id(p) for p in trainer.model.parameters()}
        ),
        "precompute_calls": cb.precompute_calls,
        "global_step": trainer.state.global_step,
        "losses": losses(trainer),
        "warnings": warned.messages,
        "without_shim": ddp_result,
    }
    # save_model gathers the sharded float8 weights into a plain hp checkpoint
    final = {}
    for name, p in trainer.model.named_parameters():
        full = p.full_tensor()  # a collective: every rank, same order
        final[name] = getattr(full, "_tensor", full).detach().clone()
    trainer.save_model(str(out / "saved"))
    if rank == 0:
        torch.save(params.params, out / "params_step1.pt")
        torch.save(final, out / "params_final.pt")
    # one file per rank: two ranks printing at once can interleave their lines
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # every rank waits, then tears gloo down itself: a rank leaving while the other is still
    # in a collective aborts gloo at exit ("terminate called without an active exception")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
