"""A small LightningModule and data for tests/test_integrations_lightning.py; run under
torchrun it trains with ModelParallelStrategy (FSDP2 in configure_model) and writes each
rank's results as JSON into the folder $FLOAT8KIT_RESULTS."""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from float8kit import Float8Linear, Float8LinearConfig
from float8kit.integrations.lightning import Float8LightningCallback

DIM, HIDDEN, OUT = 64, 128, 16


class Regressor(L.LightningModule):
    def __init__(self, shard: bool = False, optimizer=torch.optim.AdamW):
        super().__init__()
        self.optimizer = optimizer
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM))
            for _ in range(2)
        )
        self.head = nn.Linear(DIM, OUT)
        self.shard = shard
        self.losses: list[float] = []

    def configure_model(self):
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard

        for block in self.blocks:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])
        fully_shard(self, mesh=self.device_mesh["data_parallel"])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch, _):
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return self.optimizer(self.parameters(), lr=1e-3)


def data(n: int = 512) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, DIM, generator=g)
    w = torch.randn(DIM, OUT, generator=g) / DIM**0.5
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ w))


def fit(model: Regressor, steps: int, callbacks=(), **trainer_kwargs) -> L.Trainer:
    trainer = L.Trainer(
        max_steps=steps,
        accumulate_grad_batches=2,
        accelerator="cpu",
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        **trainer_kwargs,
    )
    loader = torch.utils.data.DataLoader(data(), batch_size=16, shuffle=False)
    trainer.fit(model, loader)
    return trainer


def filter_head(module: nn.Module, fqn: str) -> bool:
    return fqn != "head"


def _sharded_run(callback=None) -> dict:
    from lightning.pytorch.strategies import ModelParallelStrategy

    model = Regressor(shard=True)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    fit(model, 4, [callback] if callback else [], devices=2, strategy=strategy)
    weights = [m.weight for m in model.modules() if isinstance(m, Float8Linear)]
    return {
        "converted": callback.converted if callback else [],
        "local_types": [type(w._local_tensor).__name__ for w in weights],
        "precompute_calls": callback.precompute_calls if callback else 0,
        "losses": model.losses,
    }


if __name__ == "__main__":  # torchrun --nproc-per-node 2 tests/lightning_model.py
    # The same 4 steps (2 micro-batches each, each rank its own): bf16; float8 with hp
    # all-gather; float8 with float8 all-gather.
    runs = {
        "bf16": _sharded_run(),
        "float8": _sharded_run(Float8LightningCallback(module_filter_fn=filter_head)),
        "float8_all_gather": _sharded_run(
            Float8LightningCallback(
                Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                module_filter_fn=filter_head,
            )
        ),
    }
    # one file per rank: two ranks printing at once can interleave their lines
    rank = int(os.environ["RANK"])
    out = Path(os.environ["FLOAT8KIT_RESULTS"]) / f"rank{rank}.json"
    out.write_text(json.dumps({"rank": rank, **runs}))
    # Skip interpreter teardown, as the gloo launcher does: destroying gloo's background
    # threads at exit sometimes aborted a finished rank on a loaded machine ("terminate
    # called without an active exception", seen once in a suite run), after its file was
    # written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
