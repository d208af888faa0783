"""A shared ``fastrl vllm-server`` vs the same engine in the training process.

One random Llama (built from a config, no download), two engines with the same settings:
``VLLMGroupSampler`` in this process and ``fastrl vllm-server`` in a fresh one, queried
through ``VLLMServerSampler``. Alternating rounds (so machine load hits both alike), best of
``--rounds``:

- ``generate``: one rollout (``--prompts`` prompts of ``--prompt-len`` tokens, G samples of
  ``--gen-len`` tokens, per-prompt seeds): in-process call vs one HTTP request, and vs two
  concurrent clients with half the prompts each (two data-parallel ranks; the server
  batches them into one engine call). The samples are checked equal across the three.
- ``update_weights``: the full state dict pushed in place (in-process) vs uploaded in
  safetensors parts over HTTP, or left as files in the server's ``--weights-dir`` (on
  ``/dev/shm``), checked against the checkpoint and reloaded (server).

The model has no eos, so every sample generates exactly ``--gen-len`` tokens. Results go to
``benchmarks/results/vllm_server_<device>.json``.

    OMP_NUM_THREADS=1 python benchmarks/bench_vllm_server.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from fastrl.bench.harness import environment  # noqa: E402
from fastrl.rollout.base import SamplingConfig  # noqa: E402


def build_model(folder: str, *, hidden: int, layers: int, vocab: int, max_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128), vocab_size=vocab, max_position_embeddings=max_len,
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    return model


def start_server(folder: str, max_len: int, weights_dir: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastrl.cli", "vllm-server", "--model", folder, "--port", "0", "--max-model-len", str(max_len),
         "--kv-cache-gib", "0.5", "--weights-dir", weights_dir],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    for line in proc.stdout:
        if "ready at " in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, line.split("ready at ")[1].split()[0]
    raise SystemExit("the server did not start")


def best(times: list[float]) -> float:
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from fastrl.rollout.remote import VLLMServerSampler
    from fastrl.rollout.vllm import VLLMGroupSampler

    max_len = args.prompt_len + args.gen_len + 32
    folder = tempfile.mkdtemp(prefix="fastrl-bench-server-")
    model = build_model(folder, hidden=args.hidden, layers=args.layers, vocab=args.vocab, max_len=max_len)
    weights = list(model.state_dict().items())
    weight_mb = sum(t.nbytes for _, t in weights) / 2**20
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    proc, url = start_server(folder, max_len, tempfile.mkdtemp(prefix="fastrl-weights-", dir=shm))
    try:
        local = VLLMGroupSampler(folder, max_model_len=max_len, kv_cache_memory_bytes=512 << 20)
        remote = VLLMServerSampler(url, weights_transport="http")
        remote_file = VLLMServerSampler(url, weights_transport="file")
        gen = torch.Generator().manual_seed(1)
        sampling = SamplingConfig(max_new_tokens=args.gen_len, seed=0)
        G, half = args.group_size, args.prompts // 2
        times: dict[str, list[float]] = {k: [] for k in ("generate_in_process", "generate_server", "generate_server_2_clients",
                                                           "update_in_process", "update_server",
                                                           "update_server_file")}
        merged = []
        for round_ in range(args.rounds):
            # fresh prompts every round: no prefix-cache hits from an earlier round
            prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), generator=gen).tolist()
            seeds = list(range(round_ * 1000, round_ * 1000 + args.prompts))
            t = time.perf_counter()
            a = local.generate(prompts, group_size=G, sampling=sampling, prompt_seeds=seeds)
            times["generate_in_process"].append(time.perf_counter() - t)
            t = time.perf_counter()
            b = remote.generate(prompts, group_size=G, sampling=sampling, prompt_seeds=seeds)
            times["generate_server"].append(time.perf_counter() - t)
            # two ranks, half the prompts each, at the same moment (new prompts again)
            prompts2 = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), generator=gen).tolist()
            parts: dict[int, object] = {}
            calls = remote._request("GET", "/info")["engine_calls"]

            def rank(r: int) -> None:
                lo, hi = r * half, (r + 1) * half if r == 0 else args.prompts
                parts[r] = remote.generate(prompts2[lo:hi], group_size=G, sampling=sampling, prompt_seeds=seeds[lo:hi])

            threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            times["generate_server_2_clients"].append(time.perf_counter() - t)
            merged.append(remote._request("GET", "/info")["engine_calls"] - calls == 1)
            if a.completion_ids != b.completion_ids:
                raise SystemExit("the server's samples differ from the in-process engine's")
            t = time.perf_counter()
            local.update_weights(weights)
            times["update_in_process"].append(time.perf_counter() - t)
            t = time.perf_counter()
            version = remote.update_weights(weights)
            times["update_server"].append(time.perf_counter() - t)
            t = time.perf_counter()
            remote_file.update_weights(weights)
            times["update_server_file"].append(time.perf_counter() - t)
            remote.expect_weights_version(version + 1)
            print(f"round {round_}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=120)

    result = {
        "what": "fastrl vllm-server (HTTP, separate process) vs the same vLLM engine in-process",
        "command": "python benchmarks/bench_vllm_server.py " + " ".join(sys.argv[1:]),
        "timing": f"best of {args.rounds} alternating rounds",
        "environment": environment(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "shape": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "prompts": args.prompts,
                  "prompt_len": args.prompt_len, "group_size": G, "gen_len": args.gen_len, "weights_mb": round(weight_mb, 1)},
        "seconds_best": {k: round(best(v), 4) for k, v in times.items()},
        "seconds_all": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "two_clients_batched_into_one_engine_call": merged,
        "ratios": {
            "generate_server_over_in_process": round(best(times["generate_server"]) / best(times["generate_in_process"]), 3),
            "generate_2_clients_over_in_process": round(
                best(times["generate_server_2_clients"]) / best(times["generate_in_process"]), 3),
            "update_server_over_in_process": round(best(times["update_server"]) / best(times["update_in_process"]), 3),
            "update_server_file_over_in_process": round(best(times["update_server_file"]) / best(times["update_in_process"]), 3),
        },
        "update_server_mb_per_s": round(weight_mb / best(times["update_server"]), 1),
        "update_server_file_mb_per_s": round(weight_mb / best(times["update_server_file"]), 1),
    }
    print(json.dumps({k: result[k] for k in ("shape", "seconds_best", "ratios", "update_server_mb_per_s",
                                              "update_server_file_mb_per_s", "two_clients_batched_into_one_engine_call")}, indent=1))
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"vllm_server_{'cuda' if torch.cuda.is_available() else 'cpu'}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
