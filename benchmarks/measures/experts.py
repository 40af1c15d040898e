"""float8 MoE experts (numbers/experts.json): SQNR vs fp32 of two grouped gemms with SiLU
between, 4 experts, one of them with no tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.measures.refs import sqnr
from float8kit import (
    convert_experts_to_float8_training,
)

# 4 experts; expert 1 gets no tokens; rows past offs[-1] (60..63) belong to no expert.
OFFS = torch.tensor([16, 16, 40, 60], dtype=torch.int32)
TOKENS, DIM, HIDDEN = 64, 32, 64


class Experts(nn.Module):
    """Two grouped gemms with SiLU between: (experts, in, out) weights, tokens sorted by
    expert. ``torch._grouped_mm`` first, ``F.grouped_mm`` second (both are converted)."""

    def __init__(self, n_experts=4, dim=DIM, hidden=HIDDEN):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, dim, hidden) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, hidden, dim) / hidden**0.5)

    def forward(self, x, offs):
        h = F.silu(torch._grouped_mm(x, self.w1, offs=offs))
        return F.grouped_mm(h, self.w2, offs=offs)


def run(model, x, grad, offs=OFFS):
    x = x.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    out = model(x, offs)
    out.backward(grad)
    return out.detach(), x.grad, model.w1.grad, model.w2.grad


ACCURACY_DB = 20  # the floor for every gemm result


def experts_sqnrs() -> tuple[dict[str, float], list[torch.Tensor]]:
    """SQNR (dB) vs fp32 of the float8 experts' output, grad_input and weight grads (what
    tools/measure.py publishes), and the float8 weight grads."""
    torch.manual_seed(0)
    ref = Experts()
    f8 = convert_experts_to_float8_training(Experts())
    f8.load_state_dict(ref.state_dict())
    x, grad = torch.randn(TOKENS, DIM), torch.randn(TOKENS, DIM)
    want, got = run(ref, x, grad), run(f8, x, grad)
    n = int(OFFS[-1])  # rows past offs[-1] are no expert's: compare the routed tokens
    scores = {
        "output": sqnr(want[0][:n], got[0][:n]),
        "grad_input": sqnr(want[1][:n], got[1][:n]),
        "grad_w1": sqnr(want[2], got[2]),
        "grad_w2": sqnr(want[3], got[3]),
    }
    return scores, [got[2], got[3]]
