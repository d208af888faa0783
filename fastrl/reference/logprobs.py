"""Reference log-probs and entropy of a linear LM head: the oracle for ``fastrl.ops.logprobs``.

With hidden states ``h`` [N, H], LM head ``W`` [V, H], optional bias ``b`` [V] and
temperature ``tau``, the tempered logits and distribution of token ``n`` are

    u[n, v] = (h[n] . W[v] + b[v]) / tau
    p[n, v] = exp(u[n, v] - lse[n]),        lse[n] = log sum_v exp(u[n, v])

and the op returns, for target ``y[n]``,

    logp[n]    = u[n, y[n]] - lse[n]
    entropy[n] = -sum_v p[n, v] log p[n, v] = lse[n] - sum_v p[n, v] u[n, v]

Tokens whose target equals ``ignore_index`` get logp = entropy = 0 (and no gradient).
This materialises the whole [N, V] logits tensor; it is meant for tests and tiny inputs.
"""

from __future__ import annotations

import torch


def linear_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` of shape ``targets.shape``, computed from full logits.

    Arithmetic is done in the promoted dtype of the inputs and at least float32 (pass
    float64 tensors to get a float64 oracle). Differentiable through autograd.
    """
    dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    y = targets.reshape(-1)
    valid = y != ignore_index
    # rows of ignored targets are never read (a select, so NaN/inf there cannot leak)
    h = torch.where(valid[:, None], hidden.reshape(-1, hidden.shape[-1]).to(dtype), 0.0)
    logits = h @ weight.to(dtype).T
    if bias is not None:
        logits = logits + bias.to(dtype)
    u = logits / temperature
    log_p = torch.log_softmax(u, dim=-1)
    safe_y = torch.where(valid, y, torch.zeros_like(y))
    logp = log_p.gather(1, safe_y[:, None]).squeeze(1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    logp = torch.where(valid, logp, zero)
    entropy = torch.where(valid, entropy, zero)
    return logp.reshape(targets.shape), entropy.reshape(targets.shape)


def linear_logprobs_loop(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> tuple[list[float], list[float]]:
    """The formula written as Python loops over tokens and vocabulary (float64 math).

    Only for tiny inputs in tests: a second, independent statement of the spec.
    """
    import math

    h = hidden.reshape(-1, hidden.shape[-1]).double().tolist()
    w = weight.double().tolist()
    b = bias.double().tolist() if bias is not None else [0.0] * len(w)
    ys = targets.reshape(-1).tolist()
    out_logp, out_ent = [], []
    for n, y in enumerate(ys):
        if y == ignore_index:
            out_logp.append(0.0)
            out_ent.append(0.0)
            continue
        u = [(sum(a * c for a, c in zip(h[n], w[v])) + b[v]) / temperature for v in range(len(w))]
        m = max(u)
        s = sum(math.exp(x - m) for x in u)
        lse = m + math.log(s)
        out_logp.append(u[y] - lse)
        out_ent.append(-sum(math.exp(x - lse) * (x - lse) for x in u))
    return out_logp, out_ent
