"""No recompiles as the batch shape changes: count the JIT's compile keys per kernel.

In a training loop the token count, the padded length and the number of prompts change
every step. A kernel whose specialisation (constexprs, or the integer/alignment
specialisation the JIT derives from its arguments) follows those shapes is compiled again
and again on the GPU (0.5-1 s per bf16 compile). This walks every launcher over many batch
shapes (token counts 1..20000 in uneven steps, each as a few long rows and as many short
ones: B and T both vary) on ``meta`` tensors and counts the distinct
compile keys Triton's JIT would compute for sm_90 (its own binder and cache-key function,
see benchmarks/gpu/sm90_compile.py). No GPU is needed; it runs in a subprocess because
tests/conftest.py turns the interpreter on.

The bounds (``KEY_BOUNDS``, keyed ``module.kernel``) are per kernel and configuration (one
model, one set of flags; the walk's ``rec.label``), the most distinct keys any one
configuration needs. Nothing a launcher derives from the batch shape is a constexpr any more
(fixed blocks; loops with runtime bounds over chunks, steps and rows); what remains is the
JIT's own specialisation of an integer argument (``== 1``, ``% 16 == 0``, other: at most 3
keys for one length argument), which is kept where it pays (the divisibility of a row length
lets masked loads vectorise) and turned off with ``do_not_specialize`` where it does not
(counts that only address partials or bound loops):
- log-probs: ``_bwd_hidden_kernel`` has one flag that follows the token count (atomic adds
  when the vocabulary is split): 2 keys; the others 1, and so do the chunked path's row
  kernels (their row counts are not specialised; V is a constexpr of the model).
- decode and training attention (the shared-prefix launchers run the tree kernels): 1 key per
  (model, group size, dtype); the packed token count of the training attention specialises
  3 ways (its launchers treat ``meta`` as CUDA: fixed CUDA tiles).
- policy loss, scans, KL, value loss, whitening, advantages: the row length T (or the flat
  size N) specialises 3 ways; the finalize kernel and segment statistics: 1 key.
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
    "logprobs._fwd_kernel": 1,
    "logprobs._bwd_hidden_kernel": 2,
    "logprobs._bwd_weight_kernel": 1,
    "logprob_rows._row_stats_kernel": 1,
    "logprob_rows._row_grad_kernel": 1,
    "decode_attention._prefix_attn_kernel": 1,
    "decode_attention._suffix_merge_kernel": 1,
    "tree_attention._fwd_kernel": 3,
    "tree_attention._bwd_dq_kernel": 3,
    "tree_attention._bwd_dkdv_kernel": 3,
    "policy_loss._row_pre_kernel": 3,
    "policy_loss._policy_fwd_kernel": 3,
    "policy_loss._policy_finalize_kernel": 1,
    "policy_loss._policy_bwd_kernel": 3,
    "scans._reverse_affine_scan_kernel": 3,
    "kl._kl_fwd_kernel": 3,
    "kl._kl_bwd_kernel": 3,
    "value_loss._value_loss_kernel": 3,
    "whiten._moments_kernel": 3,
    "whiten._whiten_apply_kernel": 3,
    "whiten._grad_sums_kernel": 3,
    "whiten._whiten_bwd_kernel": 3,
    "advantages._segment_stats_kernel": 1,
    "advantages._group_adv_kernel": 3,
    "advantages._step_adv_kernel": 3,
    "turn_advantages._turn_combine_kernel": 3,
    "turn_advantages._expand_kernel": 3,
}


def token_counts(limit: int = 20000) -> list[int]:
    """1..limit in uneven steps: every count up to 130, then steps that grow and wobble."""
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n += 1 if n < 130 else max(1, n // 41) + n % 13
    return out


def batch_shapes(n: int) -> list[tuple[int, int]]:
    """[B, T] batches for a token count n: a few rows of n tokens, and about n tokens spread
    over many short rows (B from 2 to 62)."""
    rows = 2 + (n // 3) % 61
    return [(1 + n % 7, n), (rows, 1 + n // rows)]


def test_compile_keys_do_not_follow_the_batch_shape(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "keys.json"
    proc = subprocess.run([sys.executable, __file__, str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    counts = report["keys_per_kernel"]
    import csrc_triton  # every kernel module of the package is walked and has a stated bound

    modules = {p.stem for p in Path(csrc_triton.__file__).parent.glob("*.py") if "@triton.jit" in p.read_text()}
    assert {k.split(".")[0] for k in KEY_BOUNDS} == modules
    assert set(counts) == set(KEY_BOUNDS), "every kernel is walked (and has a stated bound)"
    over = {k: (n, KEY_BOUNDS[k]) for k, n in counts.items() if n > KEY_BOUNDS[k]}
    assert not over, f"kernels compiled again as the batch shape changes (keys, bound): {over}"
    # the walk is real: it launched every kernel many times, and the keys it counts do tell
    # the JIT's integer classes of the row length apart (T == 1, T % 16 == 0, other)
    assert min(report["launches_per_kernel"].values()) >= 40, report["launches_per_kernel"]
    assert counts["logprobs._bwd_hidden_kernel"] == 2
    assert counts["policy_loss._policy_fwd_kernel"] == counts["scans._reverse_affine_scan_kernel"] == 3


def walk(rec) -> None:
    """Call every launcher over many batch shapes (one model / configuration each)."""
    import torch

    from benchmarks.gpu.sm90_compile import _attn_call, _logprob_call, _policy_call, meta
    from csrc_triton.advantages import group_advantages_elementwise, segment_stats, step_advantages_tokens
    from csrc_triton.kl import kl_bwd, kl_fwd
    from csrc_triton.logprob_rows import row_grad, row_stats
    from csrc_triton.scans import discounted_returns_fwd, gae_fwd
    from csrc_triton.shared_prefix_attention import shared_prefix_attention_bwd, shared_prefix_attention_fwd
    from csrc_triton.tree_attention import tree_attention_bwd, tree_attention_fwd
    from csrc_triton.turn_advantages import expand_turn_advantages, turn_combine
    from csrc_triton.value_loss import value_loss_fused
    from csrc_triton.whiten import whiten_backward, whiten_forward

    bf16, i32, i64 = torch.bfloat16, torch.int32, torch.int64
    ns = token_counts()
    for n in ns:
        # Qwen2.5-0.5B head, bf16, entropy and bias on: n tokens of a packed batch
        rec.label = "logprobs"
        _logprob_call(rec, n, 896, 151936, bf16, bias=True, entropy=True)
        rec.label = "logprob_rows"  # the chunked path's row kernels over a chunk of n tokens
        z, y = meta(n, 151936), meta(n, dtype=i64)
        m, _, _, _ = row_stats(z, meta(151936, dtype=bf16), y, 1.0, True)
        row_grad(z, meta(n, 151936, dtype=bf16), meta(151936, dtype=bf16), y, m, m, m, m, 1.0)
        for i, (B, T) in enumerate(batch_shapes(n)):  # [B, T] token-level ops: B rows padded to T
            rec.label = "ppo"
            _policy_call(rec, B, T, bf16, ref=True, ent=True)
            rec.label = "gspo"
            _policy_call(rec, B, T, bf16, seq_ratio=True, is_=True, seq_is=True, agg="seq-mean-token-mean")
            rec.label = "token ops"
            kl_fwd(meta(B, T, dtype=bf16), meta(B, T), estimator="k3", clamp=None)
            kl_bwd(meta(B, T, dtype=bf16), meta(B, T), meta(B, T), estimator="k3", clamp=None, need_logp=True,
                   need_ref=False)
            value_loss_fused(meta(B, T), meta(B, T), meta(B, T), meta(B, T, dtype=torch.uint8), meta(B), clip=0.2,
                             write_grad=True)
            if i == 0:  # whitening sees a flat size only: the first batch of each count will do
                x, m = meta(B * T), meta(B * T, dtype=torch.bool)  # (its merges on meta are slow)
                y, mu, rstd, cnt = whiten_forward(x, m, shift_mean=True, eps=1e-8)
                whiten_backward(meta(B * T), x, m, mu, rstd, cnt, shift_mean=True)
            rec.label = "gae"
            gae_fwd(meta(B, T), meta(B, T), meta(B, T, dtype=torch.bool), 0.99, 0.95)
            rec.label = "returns"
            discounted_returns_fwd(meta(B, T), meta(B, T, dtype=torch.bool), 0.99)
            rec.label = "advantages"
            # process rewards: up to 64 steps per row
            S = 1 + (n + B) % 64
            step_advantages_tokens(meta(B, S), meta(B, S, dtype=i64), meta(B, dtype=i64), meta(B), meta(B), meta(B),
                                   meta(B, T, dtype=torch.uint8), eps=1e-6)
            rec.label = "turn advantages"  # agent trajectories: up to 16 turns per row
            K = 1 + (n + B) % 16
            turn_combine(meta(B, K), meta(B * K, dtype=torch.uint8), meta(B * K, dtype=i64), meta(B * K), meta(B * K),
                         meta(B * K), meta(B * K), meta(B), c_ep=1.0, c_rel=1.0, use_std=True, eps=1e-6)
            expand_turn_advantages(meta(B, K), meta(B, T, dtype=i64), meta(B, T, dtype=torch.uint8),
                                   meta(B, dtype=i64), use_turn=True)
        # n samples in n // 8 + 1 groups
        G = n // 8 + 1
        segment_stats(meta(n), meta(n, dtype=i64), meta(G, dtype=i64), meta(G, dtype=i64))
        group_advantages_elementwise(meta(n), meta(n, dtype=i64), meta(G), meta(G), meta(G), meta(G), meta(()),
                                     mode=0, eps=1e-6, floor=1e-6)
    # attention (Qwen2.5-1.5B heads: 12 query, 2 kv, D=128)
    rec.label = "decode attention"  # groups of 8: prompts per step, prompt and suffix lengths
    for n in ns[::7]:
        _attn_call(rec, 12, 2, 128, 8, bf16, n_groups=1 + n % 29, prefix=1 + n % 3000, suffix=1 + n % 4096)
    rec.label = "shared-prefix attention"  # n packed tokens of one training row
    for n in ns[::7]:
        q, k, v = meta(n, 12, 128, dtype=bf16), meta(n, 2, 128, dtype=bf16), meta(n, 2, 128, dtype=bf16)
        bounds = [meta(n, dtype=i32) for _ in range(4)]
        out, lse = shared_prefix_attention_fwd(q, k, v, *bounds[:3], 128**-0.5)
        shared_prefix_attention_bwd(meta(n, 12, 128, dtype=bf16), q, k, v, out, lse, *bounds, 128**-0.5)
    rec.label = "tree attention"  # n packed tokens of one prefix-tree row, its key-block lists
    for n in ns[::7]:
        q, k, v = meta(n, 12, 128, dtype=bf16), meta(n, 2, 128, dtype=bf16), meta(n, 2, 128, dtype=bf16)
        key_end, ptr, blocks = meta(n, dtype=i32), meta(n // 64 + 2, dtype=i32), meta(1 + n % 997, dtype=i32)
        out, lse = tree_attention_fwd(q, k, v, key_end, ptr, blocks, 128**-0.5)
        tree_attention_bwd(meta(n, 12, 128, dtype=bf16), q, k, v, out, lse, key_end, ptr, blocks, 128**-0.5)


def qualified_name(kernel) -> str:
    """``module.kernel``: kernel names repeat across modules (``_fwd_kernel``)."""
    return f"{kernel.fn.__module__.rsplit('.', 1)[-1]}.{kernel.fn.__name__}"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu.sm90_compile import Recorder

    keys: dict[tuple[str, str], set[str]] = {}  # (kernel, configuration) -> compile keys
    launches: dict[str, int] = {}

    class KeyRecorder(Recorder):
        def _run(self, kernel, *args, **kwargs):
            super()._run(kernel, *args, **kwargs)
            name = qualified_name(kernel)
            keys.setdefault((name, self.label), set()).add(self.launches.pop().key)
            launches[name] = launches.get(name, 0) + 1

    with KeyRecorder().active() as rec:
        walk(rec)
    counts: dict[str, int] = {}
    for (name, _), ks in keys.items():
        counts[name] = max(counts.get(name, 0), len(ks))
    report = {"token_counts": len(token_counts()), "keys_per_kernel": counts, "launches_per_kernel": launches}
    text = json.dumps(report, indent=1)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text + "\n")
    print(text)
