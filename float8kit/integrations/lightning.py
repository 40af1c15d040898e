"""float8 training in Lightning: one callback, ``Float8LightningCallback``.

    trainer = L.Trainer(..., callbacks=[Float8LightningCallback()])

Lightning has no float8 precision plugin; the clean points are:

- ``setup`` (the callback hook, called before ``LightningModule.configure_model``): the
  callback converts the LightningModule's Linears there, so that a ``configure_model`` that
  calls ``fully_shard`` (``ModelParallelStrategy``) shards float8 layers, as float8kit
  requires (convert first, then shard), and ``configure_optimizers`` sees the converted
  parameters.
- ``on_fit_start`` (the optimizers exist): the callback registers torch's optimizer step
  post-hook, so ``precompute_scales`` runs right after every real ``optimizer.step()``
  (once per optimizer step under ``accumulate_grad_batches``; not on a step a GradScaler
  skipped, which Lightning does not call ``step`` for; both are safe, see
  ``float8kit.integrations.hf``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from float8kit.integrations import missing_extra

try:
    from lightning.pytorch.callbacks import Callback
except ModuleNotFoundError as e:
    raise missing_extra("lightning", e) from e

from float8kit.config import Float8LinearConfig
from float8kit.convert import convert_to_float8_training
from float8kit.integrations import float8_linears, log_converted
from float8kit.precompute import precompute_scales

logger = logging.getLogger(__name__)


class Float8LightningCallback(Callback):
    """Converts the LightningModule to float8 training and keeps its scales up to date.

    Args:
        config: the ``Float8LinearConfig`` (default: dynamic tensorwise).
        module_filter_fn: ``fn(linear, fqn) -> bool``; default: the library's
            (``default_module_filter``: dims the float8 kernels take). Keep output heads
            and routers hp with your own filter, e.g. ``lambda m, fqn: fqn != "head"``.

    ``converted`` lists the fqns that run in float8 (logged once at INFO);
    ``precompute_calls`` counts the optimizer steps it followed.
    """

    def __init__(
        self,
        config: Float8LinearConfig | None = None,
        module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    ):
        self.config = config if config is not None else Float8LinearConfig()
        self.module_filter_fn = module_filter_fn
        self.converted: list[str] = []
        self.precompute_calls = 0
        self._handles: list = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        convert_to_float8_training(
            pl_module, config=self.config, module_filter_fn=self.module_filter_fn
        )
        self.converted, n_linears = float8_linears(pl_module)
        log_converted(logger, len(self.converted), n_linears)

    def on_fit_start(self, trainer, pl_module) -> None:
        if not trainer.optimizers:
            raise RuntimeError(
                "Float8LightningCallback: the Trainer has no optimizer at on_fit_start; "
                "precompute_scales must follow every optimizer.step(): return one from "
                "configure_optimizers"
            )

        def after_step(optimizer, args, kwargs) -> None:
            precompute_scales(pl_module)
            self.precompute_calls += 1

        self._handles = [opt.register_step_post_hook(after_step) for opt in trainer.optimizers]

    def on_fit_end(self, trainer, pl_module) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
