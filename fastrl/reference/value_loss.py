"""Reference PPO value (critic) loss with optional value clipping."""

from __future__ import annotations

import torch


def aggregate_reference(
    loss_t: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_agg: str = "token-mean",
    norm_length: float | None = None,
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregate a [B, T] per-token loss as ``PolicyLossConfig.loss_agg`` describes.

    With m = (mask != 0), n_b = sum_t m[b, t]:

    - ``token-mean``:              sum(m * l) / D_tok,         D_tok = global_token_count or sum(n_b)
    - ``seq-mean-token-mean``:     sum_b (sum_t m l / n_b) / D_seq
    - ``seq-mean-token-sum``:      sum_b (sum_t m l) / D_seq
    - ``seq-mean-token-sum-norm``: sum_b (sum_t m l / norm_length) / D_seq   (norm_length required)

    D_seq = global_seq_count or the number of rows with n_b > 0. A denominator (local or
    global) of 0 is taken as 1, so an all-masked batch gives 0 (not NaN); rows with n_b = 0
    contribute 0.
    """
    m = (mask != 0).to(loss_t.dtype)
    lm = torch.where(mask != 0, loss_t, 0.0)  # a select, so NaN/inf padding cannot leak
    n_b = m.sum(dim=1)
    def denominator(count):  # 0 is taken as 1 (fastrl._checks.check_global_count's rule)
        count = torch.as_tensor(count, dtype=loss_t.dtype, device=loss_t.device).reshape(())
        return torch.where(count > 0, count, torch.ones_like(count))

    if loss_agg == "token-mean":
        return lm.sum() / denominator(n_b.sum() if global_token_count is None else global_token_count)
    n_seq = denominator((n_b > 0).to(loss_t.dtype).sum() if global_seq_count is None else global_seq_count)
    row_sum = lm.sum(dim=1)
    if loss_agg == "seq-mean-token-mean":
        per_row = row_sum / n_b.clamp(min=1)
    elif loss_agg == "seq-mean-token-sum":
        per_row = row_sum
    elif loss_agg == "seq-mean-token-sum-norm":
        if norm_length is None:
            raise ValueError("norm_length is required with loss_agg='seq-mean-token-sum-norm'")
        per_row = row_sum / norm_length
    else:
        raise ValueError(f"unknown loss_agg {loss_agg!r}")
    return per_row.sum() / n_seq


def value_loss_reference(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = None,
    loss_agg: str = "token-mean",
    norm_length: float | None = None,
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped value loss (Schulman et al. 2017; the clipping of OpenAI baselines).

    Per token, with v = values, R = returns, v_old = old_values:

        v_clip = v_old + clamp(v - v_old, -clip, clip)
        l_t    = 0.5 * max((v - R)^2, (v_clip - R)^2)      (clip given)
        l_t    = 0.5 * (v - R)^2                           (clip=None)

    aggregated with ``aggregate_reference``. Differentiable wrt ``values`` only. Inputs are
    read only at masked-in tokens (padding may hold NaN/inf and gets zero gradient).

    Metrics (0-dim float32, over masked-in tokens; 0 when there are none):

    - ``vf_clip_frac``: fraction of tokens where the clipped term is strictly larger
      (the clipped branch is active); 0 when clip=None.
    - ``explained_variance``: 1 - Var(R - v) / Var(R); 0 when Var(R) == 0. (Either
      variance convention gives the same ratio.)
    - ``value_mean``, ``return_mean``: masked means of v and R.
    """
    dt = torch.float64 if values.dtype == torch.float64 else torch.float32
    keep = mask != 0
    v = torch.where(keep, values.to(dt), 0.0)
    v_old = torch.where(keep, old_values.to(dt), 0.0).detach()
    R = torch.where(keep, returns.to(dt), 0.0).detach()
    l1 = (v - R) ** 2
    if clip is None:
        loss_t = 0.5 * l1
        clipped = torch.zeros_like(l1, dtype=torch.bool)
    else:
        v_clip = v_old + torch.clamp(v - v_old, -clip, clip)
        l2 = (v_clip - R) ** 2
        loss_t = 0.5 * torch.maximum(l1, l2)
        clipped = l2 > l1
    loss = aggregate_reference(
        loss_t,
        mask,
        loss_agg=loss_agg,
        norm_length=norm_length,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
    )
    with torch.no_grad():
        m = mask != 0
        n = m.sum()
        vm, Rm = v.detach()[m], R[m]
        if int(n) == 0:
            zero = torch.zeros((), dtype=torch.float32)
            metrics = dict(vf_clip_frac=zero, explained_variance=zero, value_mean=zero, return_mean=zero)
        else:
            var_r = ((Rm - Rm.mean()) ** 2).mean()
            e = Rm - vm
            var_e = ((e - e.mean()) ** 2).mean()
            ev = 1.0 - var_e / var_r if float(var_r) > 0 else torch.zeros((), dtype=dt)
            metrics = dict(
                vf_clip_frac=clipped[m].to(dt).mean().float(),
                explained_variance=ev.float(),
                value_mean=vm.mean().float(),
                return_mean=Rm.mean().float(),
            )
    return loss.float() if dt != torch.float64 else loss, metrics
