"""Hooks for the trainers people use; each submodule imports its trainer, this package none.

- ``float8kit.integrations.hf``: a ``transformers.TrainerCallback`` (HF ``Trainer``, and the
  trainers built on it).
- ``float8kit.integrations.hf_experts``: expert parallelism for Hugging Face MoE models
  (``shard_hf_experts``: an experts implementation registered in transformers).
- ``float8kit.integrations.lightning``: a Lightning ``Callback``.
- ``float8kit.integrations.torchtitan``: a torchtitan 0.3 model-config converter, its
  float8 ``Linear`` module, the post-optimizer hook and a config-registry entry.

``import float8kit`` never imports this package.
"""


def missing_extra(extra: str, error: ModuleNotFoundError) -> ModuleNotFoundError:
    """The error an integration raises when its trainer is not installed: names the extra
    that installs it."""
    package = (error.name or "").split(".")[0]
    return ModuleNotFoundError(
        f"float8kit.integrations.{extra} needs {package!r}, which is not installed: "
        f"pip install 'float8kit[{extra}]'",
        name=package,
    )


def float8_linears(module):
    """``(fqns of the Linears that run in float8, number of Linears)`` in ``module``: what
    the callbacks log once, as proof that float8 is on."""
    from torch import nn

    from float8kit.linear import Float8Linear

    linears = [(fqn, m) for fqn, m in module.named_modules() if isinstance(m, nn.Linear)]
    return [fqn for fqn, m in linears if isinstance(m, Float8Linear)], len(linears)


def log_converted(logger, n_float8: int, n_linears: int) -> None:
    """The callbacks' one log line after converting, as proof that float8 is on."""
    kept = n_linears - n_float8
    logger.info(
        "float8kit: %d of %d Linear layers run in float8, %d kept in hp", n_float8, n_linears, kept
    )
