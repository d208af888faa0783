"""Named slots of the policy-loss kernels' buffers, one definition for the launcher
(``csrc_triton.policy_loss``) and the op (``fastrl.ops.policy_loss``). Pure Python: importable
without Triton (the op's PyTorch backend fills the same ``out`` vector).

``out`` (fp32 ``[NOUT]``): the loss, its metrics and ``1/D`` (the backward's scale).
``surrogate_metric`` is the surrogate's own per-token metric, as a token mean: the dual-clip
fraction (``ppo_clip``), the CISPO clip fraction, VESPO's mean weight phi; 0 for SAPO.

``part`` (fp32 ``[B, NC, NPART]``): per row chunk, the partial sums the finalize kernel reduces.
"""

from __future__ import annotations

OUT_KEYS = (
    "loss", "pg_loss", "kl_loss", "entropy_loss", "clip_frac_low", "clip_frac_high", "clip_frac",
    "surrogate_metric", "approx_kl", "kl_ref_mean", "ratio_mean", "ratio_min", "ratio_max",
    "entropy_mean", "is_weight_mean", "inv_denominator",
)
OUT = {k: i for i, k in enumerate(OUT_KEYS)}
NOUT = len(OUT_KEYS)

PART_KEYS = (
    "n", "pg", "kl", "ent", "low", "high", "surrogate_metric", "approx_kl", "ratio_sum", "ratio_min",
    "ratio_max", "is_weight_sum", "row_const",
)
"""Per chunk: masked token count; sums of pg, KL, entropy; low/high clip counts; sum of the
surrogate's metric; sums of k3(lr), the ratio; min/max of the ratio; sum of the IS weight;
the sequence-ratio row constant's share (d pg / d mean log-ratio, over n_row)."""
PART = {k: i for i, k in enumerate(PART_KEYS)}
NPART = len(PART_KEYS)
