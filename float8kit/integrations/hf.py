"""float8 training in HF ``Trainer``: one callback, ``Float8Callback``.

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[Float8Callback()])

The moments that matter, in ``Trainer``'s own order:

- ``on_init_end``: the model is on its device, and neither the optimizer nor accelerate's
  ``prepare`` (FSDP2 wrapping) exists yet: the callback converts the model there, exactly as
  ``convert_to_float8_training`` would before ``fully_shard``.
- ``on_train_begin``: after ``prepare``; a warning when ``TrainingArguments(fsdp=...)`` is set
  but accelerate did not shard the model (it turns FSDP on for accelerator devices only: on
  CPU gloo ranks it trains with DDP, silently).
- ``on_optimizer_step``: right after ``optimizer.step()``, once per real optimizer step (not
  per micro-batch under gradient accumulation): the callback calls ``precompute_scales``.
  It also runs when a GradScaler skipped the step; that is safe: the weights did not change,
  so their precomputed scales come out the same, and the delayed amaxes it folds in were
  observed by forward/backward passes that did run.

Refusals, each naming the fix: a model that is already sharded (DTensor parameters), an
optimizer passed to ``Trainer`` while the conversion replaces parameters (float8
all-gather: the optimizer would hold the old ones), and accelerate's own fp8
(``ACCELERATE_MIXED_PRECISION=fp8`` without ``bf16``/``fp16``), which would convert
float8kit's layers again with torchao's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from float8kit.integrations import missing_extra

try:
    from transformers import TrainerCallback
except ModuleNotFoundError as e:
    raise missing_extra("hf", e) from e

from float8kit.config import Float8LinearConfig
from float8kit.convert import convert_to_float8_training, default_module_filter
from float8kit.integrations import float8_linears
from float8kit.linear import Float8Linear
from float8kit.precompute import precompute_scales

logger = logging.getLogger(__name__)

# Last names of the Linears an HF causal LM keeps in hp by default: the output head (its
# logits feed a softmax over the vocabulary) and MoE routers (a flipped top-k choice moves a
# token to another expert).
HP_LAYER_NAMES = ("lm_head", "gate", "router")


def default_hf_filter(config: Float8LinearConfig) -> Callable[[nn.Module, str], bool]:
    """The ``module_filter_fn`` ``Float8Callback`` uses unless given one: the library's
    default (dims the float8 kernels take, ``default_module_filter``) minus the layers named
    in ``HP_LAYER_NAMES`` (``mlp.gate_proj`` of a dense model is converted; an MoE block's
    ``gate`` router is not)."""

    def keep(module: nn.Module, fqn: str) -> bool:
        if fqn.rsplit(".", 1)[-1] in HP_LAYER_NAMES:
            return False
        return default_module_filter(module, fqn, config)

    return keep


class Float8Callback(TrainerCallback):
    """Converts the Trainer's model to float8 training and keeps its scales up to date.

    Args:
        config: the ``Float8LinearConfig`` (default: dynamic tensorwise).
        module_filter_fn: ``fn(linear, fqn) -> bool``; default ``default_hf_filter(config)``.

    After ``on_init_end``, ``converted`` lists the fqns of the layers that run in float8
    (logged once at INFO, with the count of the Linears kept in hp).
    """

    def __init__(
        self,
        config: Float8LinearConfig | None = None,
        module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    ):
        self.config = config if config is not None else Float8LinearConfig()
        self.module_filter_fn = module_filter_fn or default_hf_filter(self.config)
        self.converted: list[str] = []
        self.precompute_calls = 0

    def on_init_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None:
            raise ValueError("Float8Callback: Trainer passed no model to on_init_end")
        if getattr(args, "mixed_precision", "no") == "fp8":
            raise ValueError(
                "Float8Callback: accelerate's own fp8 is on (ACCELERATE_MIXED_PRECISION=fp8 "
                "and neither bf16 nor fp16 set): accelerate would convert float8kit's layers "
                "again with its fp8 backend. Unset ACCELERATE_MIXED_PRECISION or set "
                "TrainingArguments(bf16=True): float8kit does the float8 part"
            )
        if optimizer is not None and self.config.enable_fsdp_float8_all_gather:
            raise ValueError(
                "Float8Callback: an optimizer was passed to Trainer(optimizers=...), and "
                "enable_fsdp_float8_all_gather=True replaces the converted weights with new "
                "parameters the optimizer would not hold. Let Trainer create the optimizer, "
                "or convert with convert_to_float8_training(model, config=...) before "
                "building your optimizer and drop the callback's conversion"
            )
        already = {fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
        convert_to_float8_training(
            model, config=self.config, module_filter_fn=self.module_filter_fn
        )
        self.converted, n_linears = float8_linears(model)
        logger.info(
            "float8kit: %d of %d Linear layers run in float8 (%d converted now), %d kept in hp",
            len(self.converted),
            n_linears,
            len(set(self.converted) - already),
            n_linears - len(self.converted),
        )
        return control

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        sharded = model is not None and any(isinstance(m, FSDPModule) for m in model.modules())
        if getattr(args, "fsdp", False) and model is not None and not sharded:
            logger.warning(
                "float8kit: TrainingArguments(fsdp=...) is set but accelerate did not shard "
                "the model (no fully_shard): training runs without FSDP, and float8 "
                "all-gather does not apply. accelerate turns FSDP on for accelerator "
                "devices only (on CPU gloo ranks, use_cpu=True, it trains with DDP)"
            )
        return control

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        precompute_scales(model)
        self.precompute_calls += 1
        return control
