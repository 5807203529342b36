"""The gated activation of a GLU MLP with routing probabilities, the definition (in fp32).

h [N, 2F] is fc1's output, gate and up stacked along the last dimension (megatron's layout);
act(x) = x sigmoid(alpha x) (alpha = 1: SwiGLU's silu; 1.702: the quick-GELU GLU); p [N] the
routing probability of each row (None: 1):

    a = act(gate) (up + offset) p                                  [N, F], rounded once to h's dtype

and for the backward, given da [N, F], with sg = sigmoid(alpha gate), v = up + offset:

    d gate = da p v (sg + alpha gate sg (1 - sg))      d up = da p act(gate)
    d p    = sum over F of da act(gate) v
"""

from __future__ import annotations

import torch


def glu_reference(h_N2F: torch.Tensor, probs_N: torch.Tensor | None, alpha: float = 1.0,
                  offset: float = 0.0) -> torch.Tensor:
    gate, up = h_N2F.float().chunk(2, dim=-1)
    a = gate * torch.sigmoid(alpha * gate) * (up + offset)
    if probs_N is not None:
        a = a * probs_N.float()[:, None]
    return a.to(h_N2F.dtype)
