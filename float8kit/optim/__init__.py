"""Optimizers whose states are block-quantized: ``AdamW8bit`` and ``AdamW4bit``, drop-in for
``torch.optim.AdamW``, the same numbers on any FSDP2 mesh (docs/optim.md).

    from float8kit.optim import AdamW8bit
    opt = AdamW8bit(model.parameters(), lr=3e-4, weight_decay=0.1)
"""

from float8kit.optim.adamw import AdamW4bit, AdamW8bit

__all__ = ["AdamW8bit", "AdamW4bit"]
