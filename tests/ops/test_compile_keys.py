"""No recompiles as the batch shape changes: count the JIT's compile keys per kernel.

In a training loop the token count, the padded length and the number of prompts change
every step. A kernel whose specialisation (constexprs, or the integer/alignment
specialisation the JIT derives from its arguments) follows those shapes is compiled again
and again on the GPU (0.5-1 s per bf16 compile). This walks every launcher over many batch
shapes (token counts 1..20000 in uneven steps) on ``meta`` tensors and counts the distinct
compile keys Triton's JIT would compute for sm_90 (its own binder and cache-key function,
see benchmarks/gpu/sm90_compile.py). No GPU is needed; it runs in a subprocess because
tests/conftest.py turns the interpreter on.

The bounds (``KEY_BOUNDS``) are per kernel and configuration (one model, one set of flags;
the walk's ``rec.label``), the most distinct keys any one configuration needs:
- log-probs: the vocabulary split is a runtime argument; ``_bwd_hidden_kernel`` has one
  flag that follows the token count (atomic adds when the vocabulary is split): 2 keys.
- decode attention: 1 key per (model, group size, dtype), whatever the batch and lengths.
- the other kernels pick a power-of-two block from the padded length T (and the JIT
  specialises T on ``T == 1`` / ``T % 16 == 0``): bounded by O(log T), stated as measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Upper bounds on distinct compile keys over the walk (one model / configuration each).
KEY_BOUNDS = {
    "_fwd_kernel": 1,
    "_bwd_hidden_kernel": 2,
    "_bwd_weight_kernel": 1,
    "_prefix_attn_kernel": 1,
    "_suffix_merge_kernel": 1,
    # As measured (csrc_triton/{policy_loss,scans,advantages}.py are not changed here): a
    # power-of-two block min(1024, next_pow2(T)) and NC_P2 = next_pow2(cdiv(T, 1024)) are
    # constexprs, times the JIT's "T == 1" / "T % 16 == 0" specialisation of T and the row
    # strides. benchmarks/gpu/README.md ("Compile keys") says how to bring them to <= 3.
    "_row_pre_kernel": 21,
    "_policy_fwd_kernel": 29,
    "_policy_finalize_kernel": 14,
    "_policy_bwd_kernel": 18,
    "_reverse_affine_scan_kernel": 28,
    "_step_adv_kernel": 10,
    # runtime sizes only: the JIT specialises each integer argument three ways (== 1,
    # % 16 == 0, other), so k size arguments give at most 3**k keys, whatever the range
    "_kl_fwd_kernel": 3,
    "_kl_bwd_kernel": 3,
    "_value_loss_kernel": 27,  # N, T, number of blocks
    "_moments_kernel": 3,
    "_whiten_apply_kernel": 3,
    "_grad_sums_kernel": 3,
    "_whiten_bwd_kernel": 3,
    "_segment_stats_kernel": 1,
    "_group_adv_kernel": 3,
}


def token_counts(limit: int = 20000) -> list[int]:
    """1..limit in uneven steps: every count up to 130, then steps that grow and wobble."""
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n += 1 if n < 130 else max(1, n // 41) + n % 13
    return out


def test_compile_keys_do_not_follow_the_batch_shape(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "keys.json"
    proc = subprocess.run([sys.executable, __file__, str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = json.loads(out.read_text())["keys_per_kernel"]
    assert set(counts) == set(KEY_BOUNDS), "every kernel is walked (and has a stated bound)"
    over = {k: (n, KEY_BOUNDS[k]) for k, n in counts.items() if n > KEY_BOUNDS[k]}
    assert not over, f"kernels compiled again as the batch shape changes (keys, bound): {over}"
    # the walk is real: the kernels whose specialisation does follow T show it
    assert counts["_policy_fwd_kernel"] > 1 and counts["_bwd_hidden_kernel"] == 2


def walk(rec) -> None:
    """Call every launcher over many batch shapes (one model / configuration each)."""
    import torch

    from benchmarks.gpu.sm90_compile import _attn_call, _logprob_call, _policy_call, meta
    from csrc_triton.advantages import group_advantages_elementwise, segment_stats, step_advantages_tokens
    from csrc_triton.kl import kl_bwd, kl_fwd
    from csrc_triton.scans import discounted_returns_fwd, gae_fwd
    from csrc_triton.value_loss import value_loss_fused
    from csrc_triton.whiten import whiten_backward, whiten_forward

    bf16 = torch.bfloat16
    ns = token_counts()
    for n in ns:
        # Qwen2.5-0.5B head, bf16, entropy and bias on: n tokens of a packed batch
        rec.label = "logprobs"
        _logprob_call(rec, n, 896, 151936, bf16, bias=True, entropy=True)
        # [B, T] token-level ops: B rows padded to T
        B, T = 1 + n % 7, n
        rec.label = "ppo"
        _policy_call(rec, B, T, bf16, ref=True, ent=True)
        rec.label = "gspo"
        _policy_call(rec, B, T, bf16, seq_ratio=True)  # the row pre-pass
        rec.label = "token ops"
        kl_fwd(meta(B, T, dtype=bf16), meta(B, T), estimator="k3", clamp=None)
        kl_bwd(meta(B, T, dtype=bf16), meta(B, T), meta(B, T), estimator="k3", clamp=None, need_logp=True,
               need_ref=False)
        value_loss_fused(meta(B, T), meta(B, T), meta(B, T), meta(B, T, dtype=torch.uint8), meta(B), clip=0.2,
                         write_grad=True)
        x, m = meta(B * T), meta(B * T, dtype=torch.bool)
        y, mu, rstd, cnt = whiten_forward(x, m, shift_mean=True, eps=1e-8)
        whiten_backward(meta(B * T), x, m, mu, rstd, cnt, shift_mean=True)
        rec.label = "gae"
        gae_fwd(meta(B, T), meta(B, T), meta(B, T, dtype=torch.bool), 0.99, 0.95)
        rec.label = "returns"
        discounted_returns_fwd(meta(B, T), meta(B, T, dtype=torch.bool), 0.99)
        rec.label = "advantages"
        # n samples in n // 8 + 1 groups; process rewards: up to 64 steps per row
        G = n // 8 + 1
        segment_stats(meta(n), meta(n, dtype=torch.int64), meta(G, dtype=torch.int64), meta(G, dtype=torch.int64))
        group_advantages_elementwise(meta(n), meta(n, dtype=torch.int64), meta(G), meta(G), meta(G), meta(G), meta(()),
                                     mode=0, eps=1e-6, floor=1e-6)
        S = 1 + n % 64
        step_advantages_tokens(meta(B, S), meta(B, S, dtype=torch.int64), meta(B, dtype=torch.int64), meta(B),
                               meta(B), meta(B), meta(B, T, dtype=torch.uint8), eps=1e-6)
    # decode attention (Qwen2.5-1.5B heads, groups of 8): prompts per step, prompt and suffix lengths
    rec.label = "decode attention"
    for n in ns[::7]:
        _attn_call(rec, 12, 2, 128, 8, bf16, n_groups=1 + n % 29, prefix=1 + n % 3000, suffix=1 + n % 4096)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu.sm90_compile import Recorder

    rec = Recorder()
    with rec.active():
        walk(rec)
    keys: dict[tuple[str, str], set[str]] = {}  # (kernel, configuration) -> compile keys
    for (name, key), labels in rec.labels.items():
        for label in labels:
            keys.setdefault((name, label), set()).add(key)
    counts: dict[str, int] = {}
    for (name, label), ks in keys.items():
        counts[name] = max(counts.get(name, 0), len(ks))
    launches: dict[str, int] = {}
    for launch in rec.launches:
        launches[launch.name] = launches.get(launch.name, 0) + 1
    report = {"token_counts": len(token_counts()), "keys_per_kernel": counts, "launches_per_kernel": launches}
    text = json.dumps(report, indent=1)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text + "\n")
    print(text)
