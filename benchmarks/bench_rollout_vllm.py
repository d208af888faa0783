"""vLLM group sampling: n=G with prefix caching vs G independent prefills.

For each prompt length P, group size G and completion length L, two engines sample the
same fresh prompts (a random Llama built from a config, no download):

- ``shared``: ``VLLMGroupSampler`` with prefix caching on: one request per prompt with
  ``n = G``; the group's samples reuse the prompt's full KV blocks.
- ``duplicated``: the same sampler with prefix caching off, so each of the G samples
  computes the whole prompt (equivalent to submitting G copies of the prompt).
- ``distinct``: in the ``shared`` engine, right after each shared run, G *different*
  prompts of length P (n = 1 each): the same work as ``duplicated`` (nothing to share),
  measured in the same engine at the same moment, so machine load affects both alike.

Reported per run: prompt tokens computed, prefix-cache hit rate, generated tokens, wall
time of the ``generate`` call (the fastest of ``--repeats`` runs on fresh prompts), and the
ratios duplicated / shared. ``L = 1`` isolates the prefill; at larger L the decode steps
(the same work in both modes) dilute the difference. The model has no eos
token, so every sample generates exactly L tokens. Results go to
``benchmarks/results/rollout_vllm_<device>.json``.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/bench_rollout_vllm.py \
        --prompt-lens 512 2048 --group-sizes 4 8 16 --gen-lens 1 64
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM's default ("auto") pins the engine's OpenMP thread to a fixed core: on a machine
# shared with other work, a busy core then slows the engine 10x or more at random.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fastrl.bench.harness import environment  # noqa: E402
from fastrl.rollout.base import SamplingConfig  # noqa: E402


def build_model(folder: str, *, hidden: int, layers: int, vocab: int, max_len: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        vocab_size=vocab,
        max_position_embeddings=max_len,
        bos_token_id=None,
        eos_token_id=None,  # no eos: every sample runs to max_new_tokens
        pad_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--group-sizes", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--gen-lens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--num-prompts", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="fresh prompts each time; the fastest run is kept")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--kv-cache-mb", type=int, default=1024)
    ap.add_argument("--modes", nargs=2, default=["shared", "duplicated"], choices=["shared", "duplicated"],
                    help="engine order (each engine runs the whole grid)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "rollout_vllm_cpu.json"))
    args = ap.parse_args()

    from fastrl.rollout.vllm import VLLMGroupSampler

    max_len = max(args.prompt_lens) + max(args.gen_lens)
    folder = tempfile.mkdtemp(prefix="fastrl_bench_vllm_")
    build_model(folder, hidden=args.hidden, layers=args.layers, vocab=args.vocab, max_len=max_len)
    gen = torch.Generator().manual_seed(0)

    rows = []
    for mode in args.modes:
        caching = mode == "shared"
        sampler = VLLMGroupSampler(
            folder,
            block_size=args.block_size,
            max_model_len=max_len,
            kv_cache_memory_bytes=args.kv_cache_mb << 20,
            enable_prefix_caching=caching,
        )
        warm = [torch.randint(1, args.vocab, (16,), generator=gen).tolist()]
        sampler.generate(warm, group_size=2, sampling=SamplingConfig(max_new_tokens=2, seed=0))
        for P in args.prompt_lens:
            for G in args.group_sizes:
                for L in args.gen_lens:
                    # the same fresh prompts for both modes (seeded by the shape), new ones per repeat
                    g = torch.Generator().manual_seed(P * 1000 + G * 10 + L)
                    runs: dict[str, list] = {mode: []}
                    if caching:
                        runs["distinct"] = []
                    for _ in range(args.repeats):
                        prompts = [torch.randint(1, args.vocab, (P,), generator=g).tolist() for _ in range(args.num_prompts)]
                        sampling = SamplingConfig(max_new_tokens=L, seed=1)
                        runs[mode].append(sampler.generate(prompts, group_size=G, sampling=sampling).stats)
                        if caching:
                            # same engine, same moment: G different prompts, nothing to share
                            distinct = [torch.randint(1, args.vocab, (P,), generator=g).tolist()
                                        for _ in range(args.num_prompts * G)]
                            runs["distinct"].append(sampler.generate(distinct, group_size=1, sampling=sampling).stats)
                    for name, stats in runs.items():
                        st = min(stats, key=lambda r: r.seconds)
                        row = dict(
                            mode=name, P=P, G=G, L=L, prompts=args.num_prompts,
                            prefill_tokens_computed=st.prefill_tokens_computed,
                            prefix_tokens_reused=st.prefix_tokens_reused,
                            prefix_cache_hit_rate=st.prefix_cache_hit_rate,
                            generated_tokens=st.generated_tokens,
                            seconds=st.seconds,
                            seconds_all=[r.seconds for r in stats],
                        )
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        sampler.close()
        del sampler
        gc.collect()

    shared = {(r["P"], r["G"], r["L"]): r for r in rows if r["mode"] == "shared"}
    distinct = {(r["P"], r["G"], r["L"]): r for r in rows if r["mode"] == "distinct"}
    summary = []
    for r in rows:
        if r["mode"] != "duplicated":
            continue
        s = shared[(r["P"], r["G"], r["L"])]
        d = distinct[(r["P"], r["G"], r["L"])]
        summary.append(dict(
            P=r["P"], G=r["G"], L=r["L"],
            prefill_shared=s["prefill_tokens_computed"], prefill_duplicated=r["prefill_tokens_computed"],
            prefill_ratio=r["prefill_tokens_computed"] / max(1, s["prefill_tokens_computed"]),
            hit_rate_shared=s["prefix_cache_hit_rate"],
            seconds_shared=s["seconds"], seconds_duplicated=r["seconds"],
            time_ratio=r["seconds"] / s["seconds"],
            seconds_distinct=d["seconds"], time_ratio_distinct=d["seconds"] / s["seconds"],
        ))
    print(f"\n{'P':>5} {'G':>3} {'L':>4} {'prefill shared':>15} {'prefill dup':>12} {'x':>6} {'hit rate':>9} "
          f"{'s shared':>9} {'s dup':>8} {'x':>6} {'s distinct':>10} {'x':>6}")
    for s in summary:
        print(f"{s['P']:>5} {s['G']:>3} {s['L']:>4} {s['prefill_shared']:>15} {s['prefill_duplicated']:>12} "
              f"{s['prefill_ratio']:>6.2f} {s['hit_rate_shared']:>9.3f} {s['seconds_shared']:>9.2f} "
              f"{s['seconds_duplicated']:>8.2f} {s['time_ratio']:>6.2f} {s['seconds_distinct']:>10.2f} "
              f"{s['time_ratio_distinct']:>6.2f}")

    import vllm

    env = environment(torch.device("cpu"))
    env["vllm"] = vllm.__version__
    env["torch_threads_in_engine"] = torch.get_num_threads()
    env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        benchmark="rollout_vllm: n=G shared prefix (prefix caching) vs duplicated prompts (no caching)",
        command=" ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        environment=env,
        model=dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab, dtype="float32"),
        block_size=args.block_size,
        rows=rows,
        summary=summary,
    ), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
