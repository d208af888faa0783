"""Tree rollouts vs independent samples at the same number of leaves, CPU: sampling and training.

G = 8 leaves per prompt, sampled three ways on the HF sampler (a tiny Llama, random init, fp32):

- ``independent``: ``HFGroupSampler.generate(group_size=8)`` (the prompt's KV shared, 8 paths);
- ``tree-fork``: ``sample_tree`` with branches (2, 4) at depths (0, L/2): 2 paths to the
  branch point, each forked into 4 (the HF path: the trajectory KV copied, nothing recomputed);
- ``tree-levels``: the same tree through ``generate`` per level (the path other samplers take:
  each level prefills ``prompt + path so far``; vLLM's prefix cache would skip that, HF's
  ``generate`` does not), to show what the fork saves.

Then one training forward + backward of the policy loss over the ``tree-fork`` batch on the
group layout (``[prompt | c_1 | ... | c_G]``: each leaf's shared first segment repeated) and on
the prefix-tree layout that ``--prefix_tree auto`` picks for it (each shared segment once).

Reported: generated tokens (the equal-budget figure: a shared segment counts once), the
leaves' tokens, the trained tokens of each layout, CPU seconds (``time.process_time``, best of
``--rounds``, the modes interleaved in one process, threads pinned), the load average.

    OMP_NUM_THREADS=1 python benchmarks/bench_tree_rollout.py --threads 1 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SAMPLE_MODES = ("independent", "tree-fork", "tree-levels")
TRAIN_MODES = ("group", "tree")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt_len", type=int, default=32)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "tree_rollout_cpu.json"))
    args = ap.parse_args(argv)

    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastrl.config import PolicyLossConfig
    from fastrl.ops.policy_loss import policy_loss
    from fastrl.rollout import HFGroupSampler, SamplingConfig
    from fastrl.rollout.branch import BranchSchedule, sample_tree
    from fastrl.train.experience import Experience
    from fastrl.train.layout import AutoTreeLayout, GroupPackedLayout

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    V, G, L = 512, 8, args.max_new_tokens
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=1024, eos_token_id=2, pad_token_id=0))
    model.eval()
    sampler = HFGroupSampler(model, backend="torch")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, V, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    seeds = list(range(args.prompts))
    sampling = SamplingConfig(max_new_tokens=L, seed=0)
    schedule = BranchSchedule(branches=(2, 4), depths=(0, L // 2))

    class GenerateOnly:
        def __init__(self, s):
            self.generate, self.pad_token_id = s.generate, s.pad_token_id

    def sample(mode):
        if mode == "independent":
            return sampler.generate(prompts, group_size=G, sampling=sampling, prompt_seeds=seeds)
        target = sampler if mode == "tree-fork" else GenerateOnly(sampler)
        return sample_tree(target, prompts, schedule=schedule, sampling=sampling, prompt_seeds=seeds)

    best = {m: float("inf") for m in (*SAMPLE_MODES, *(f"train-{t}" for t in TRAIN_MODES))}
    facts: dict[str, dict] = {}
    cfg = PolicyLossConfig(loss_agg="token-mean")
    common = dict(token_budget=1 << 20, device=torch.device("cpu"), temperature=1.0)
    layouts = {"group": GroupPackedLayout(**common), "tree": AutoTreeLayout(**common)}
    model.train()
    for r in range(args.rounds):
        for mode in SAMPLE_MODES:
            t = time.process_time()
            batch = sample(mode)
            best[mode] = min(best[mode], time.process_time() - t)
            facts[mode] = {"generated_tokens": batch.stats.generated_tokens,
                           "leaf_tokens": sum(len(c) for c in batch.completion_ids),
                           "prefill_tokens": batch.stats.prefill_tokens_computed}
            if mode == "tree-fork":
                tree_batch = batch
        exp = Experience.from_rollout(tree_batch, group_size=G, rewards=torch.randn(G * args.prompts), device=torch.device("cpu"))
        exp.advantages = torch.randn(exp.num_samples)
        for name, layout in layouts.items():
            model.zero_grad(set_to_none=True)
            t = time.process_time()
            counts = exp.counts(exp.rows())
            for mb in layout.micro_batches(exp):
                with layout.attention(mb, [model]):
                    logp, _ = layout.logprobs(model, mb, entropy=False)
                    take = lambda x: layout.gather(mb, x)
                    loss, _ = policy_loss(logp, take(exp.sampler_logp), take(exp.advantages), take(exp.loss_mask), config=cfg,
                                          global_counts=counts, cu_seqlens=layout.cu_seqlens(mb), backend="torch")
                    loss.backward()
            best[f"train-{name}"] = min(best[f"train-{name}"], time.process_time() - t)
            facts[f"train-{name}"] = {"forward_tokens": layout.cost(exp, range(exp.num_groups)),
                                      **({"describe": layout.describe(exp)} if name == "tree" else {})}
    result = {
        "command": "OMP_NUM_THREADS=%s python benchmarks/bench_tree_rollout.py %s" % (os.environ.get("OMP_NUM_THREADS", ""),
                                                                                   " ".join(sys.argv[1:] if argv is None else argv)),
        "device": "cpu", "platform": platform.platform(), "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": args.threads, "rounds": args.rounds, "loadavg": os.getloadavg(),
        "shape": {"prompts": args.prompts, "prompt_len": args.prompt_len, "group_size": G, "max_new_tokens": L,
                  "hidden": args.hidden, "layers": args.layers, "vocab": V, "schedule": {"branches": schedule.branches,
                                                                                      "depths": schedule.depths}},
        "cpu_seconds_best": best, "facts": facts,
        "ratios": {"tree-fork / independent (sampling CPU s)": best["tree-fork"] / best["independent"],
                   "tree-levels / tree-fork (sampling CPU s)": best["tree-levels"] / best["tree-fork"],
                   "train tree / group (CPU s)": best["train-tree"] / best["train-group"]},
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
