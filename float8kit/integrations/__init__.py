"""Hooks for the trainers people use; each submodule imports its trainer, this package none.

- ``float8kit.integrations.hf``: a ``transformers.TrainerCallback`` (HF ``Trainer``, and the
  trainers built on it).
- ``float8kit.integrations.lightning``: a Lightning ``Callback``.

``import float8kit`` never imports this package.
"""
