"""``fastrl vllm-server``: one vLLM engine shared by trainers over HTTP.

Start it where the engine should run (a GPU of its own, or this CPU)::

    fastrl vllm-server --model ./my-model --port 8000
    fastrl train --sampler vllm-server http://127.0.0.1:8000 ...

It serves a ``VLLMGroupSampler`` (prefix caching, log-probs of the distribution sampled from,
per-prompt seeds) through the API that ``fastrl.rollout.remote.VLLMServerSampler`` speaks
(see that module for the wire format). The model folder gives the architecture and the
starting weights; a trainer pushes its own weights before its first rollout and after every
update.

Concurrency: one engine thread runs every request in arrival order. Generation requests
that arrive within ``coalesce_ms`` of each other with the same sampling settings and
per-prompt seeds (data-parallel ranks sampling their shares of one batch) run as one engine
call, which is how vLLM batches best; their samples do not change, since each prompt's
random numbers come from its own seed. Weight uploads are never reordered with generations.

The server trusts its clients: it listens on 127.0.0.1 unless ``--host`` says otherwise, and
anyone who can reach it can replace its weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import sys
import threading
import time
import urllib.parse
import uuid
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from fastrl.rollout.base import RolloutStats, SamplingConfig
from fastrl.rollout.remote import encode_array, marker_name, sampling_from_json, sampling_to_json

__all__ = ["SamplerService", "add_server_arguments", "run_server", "serve"]


class BadRequest(ValueError):
    """The client's request is wrong (HTTP 400)."""


@dataclass
class _Generate:
    prompts: list[list[int]]
    group_size: int
    sampling: SamplingConfig
    prompt_seeds: list[int] | None
    future: Future = field(default_factory=Future)

    def merge_key(self) -> str | None:
        """Requests with equal keys may share one engine call without changing their samples:
        greedy ones, and sampled ones whose every prompt has its own seed."""
        if not (self.sampling.greedy or self.prompt_seeds is not None):
            return None
        return json.dumps([self.group_size, sampling_to_json(self.sampling)], sort_keys=True)


@dataclass
class _Update:
    named: list[tuple[str, torch.Tensor]]
    future: Future = field(default_factory=Future)


class SamplerService:
    """The engine thread and the state behind the HTTP handlers (usable without HTTP)."""

    def __init__(self, sampler: Any, *, coalesce_seconds: float = 0.02, weight_shapes: dict[str, tuple[int, ...]] | None = None,
                 tied_embeddings: bool = False, weights_dir: str | None = None) -> None:
        self.sampler = sampler
        # the checkpoint's weights by name: an upload must match them before it reaches the
        # engine (a wrong-shaped reload was seen to leave vLLM unable to load even good weights)
        self.weight_shapes = weight_shapes
        self.tied_embeddings = tied_embeddings
        self.coalesce_seconds = float(coalesce_seconds)
        self.instance = uuid.uuid4().hex
        self.weights_version = 0
        self.weights_error: str | None = None
        self.engine_calls = 0
        self._jobs: "queue.Queue[_Generate | _Update | None]" = queue.Queue()
        self._uploads_lock = threading.Lock()
        self._upload_id: str | None = None
        self._upload_parts: list[tuple[str, torch.Tensor]] = []
        self._upload_next = 0
        # clients on this host write weight parts here (see remote.marker_name)
        self.weights_dir = None if weights_dir is None else os.path.abspath(weights_dir)
        if self.weights_dir is not None:
            os.makedirs(self.weights_dir, exist_ok=True)
            with open(os.path.join(self.weights_dir, marker_name(self.instance)), "w") as f:
                f.write(f"fastrl vllm-server {self.instance}, pid {os.getpid()}\n")
        self._thread = threading.Thread(target=self._engine_loop, name="fastrl-vllm-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ requests
    def info(self) -> dict[str, Any]:
        s = self.sampler
        return {
            "server": "fastrl-vllm", "instance": self.instance, "weights_version": self.weights_version,
            "vocab_size": s.vocab_size, "max_model_len": s.max_model_len, "eos_token_ids": list(s.eos_token_ids),
            "pad_token_id": s.pad_token_id, "block_size": s.block_size, "prefix_caching": s.prefix_caching,
            "engine_calls": self.engine_calls, "weights_error": self.weights_error,
            "model": model_summary(s.llm.llm_engine.model_config.hf_config), "weights_dir": self.weights_dir,
            "engine": engine_summary(s.llm.llm_engine.vllm_config),
        }

    def generate(self, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict):
            raise BadRequest("the body must be a JSON object")
        try:
            job = _Generate(
                prompts=request["prompts"], group_size=request["group_size"], sampling=sampling_from_json(request["sampling"]),
                prompt_seeds=request.get("prompt_seeds"),
            )
        except KeyError as e:
            raise BadRequest(f"missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise BadRequest(str(e)) from None
        seeds = job.prompt_seeds
        if seeds is not None:  # checked here, not coerced: this is JSON from the network
            if not isinstance(seeds, list) or not all(isinstance(x, int) for x in seeds):
                raise BadRequest("prompt_seeds must be a list of ints")
            if not isinstance(job.prompts, list) or len(seeds) != len(job.prompts):
                raise BadRequest("prompt_seeds must have one seed per prompt")
        self._jobs.put(job)
        return job.future.result()

    def upload(self, upload_id: str, part: int, last: bool, body: bytes, file: str | None = None) -> dict[str, Any]:
        """One safetensors part of a weight update (the body, or ``file`` in the weights
        directory); the last one loads them all."""
        from safetensors.torch import load, load_file

        if file is not None:
            if self.weights_dir is None:
                raise BadRequest("this server has no --weights-dir: send the weights in the request body")
            if os.path.basename(file) != file or not file.endswith(".safetensors"):
                raise BadRequest(f"file must be the name of a .safetensors file in the weights directory, got {file!r}")
            path = os.path.join(self.weights_dir, file)
            try:
                tensors = load_file(path)
            except FileNotFoundError:
                raise BadRequest(f"no file {file!r} in the server's weights directory {self.weights_dir}") from None
            except Exception as e:  # noqa: BLE001 - whatever safetensors says about a bad file
                raise BadRequest(f"{file} is not a safetensors file: {e}") from None
        else:
            try:
                tensors = load(body)
            except Exception as e:  # noqa: BLE001 - whatever safetensors says about bad bytes
                raise BadRequest(f"the body is not a safetensors file: {e}") from None
        with self._uploads_lock:
            if part == 0:  # a new upload replaces an unfinished one (its client died or gave up)
                self._upload_id, self._upload_parts, self._upload_next = upload_id, [], 0
            if upload_id != self._upload_id or part != self._upload_next:
                raise BadRequest(f"upload {upload_id} part {part} is out of order (expected upload {self._upload_id} part "
                                 f"{self._upload_next})")
            self._upload_parts.extend(tensors.items())
            self._upload_next += 1
            if not last:
                return {"instance": self.instance, "weights_version": self.weights_version, "received": len(tensors)}
            named, self._upload_id, self._upload_parts = self._upload_parts, None, []
        named = self._check_weights(named)
        job = _Update(named)
        self._jobs.put(job)
        return job.future.result()

    def _check_weights(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Every weight of the checkpoint, each once, with its shape, as floats (BadRequest
        otherwise). A tied lm_head (absent from the checkpoint) is dropped."""
        for name, t in named:
            if not t.is_floating_point():
                raise BadRequest(f"weight {name!r} has dtype {t.dtype}; weights must be floating point")
        if self.weight_shapes is None:
            return named
        if self.tied_embeddings:
            named = [(n, t) for n, t in named if not (n.endswith("lm_head.weight") and n not in self.weight_shapes)]
        seen: set[str] = set()
        for name, t in named:
            if name not in self.weight_shapes:
                raise BadRequest(f"the served model has no weight named {name!r}")
            if name in seen:
                raise BadRequest(f"weight {name!r} was sent twice")
            seen.add(name)
            if tuple(t.shape) != self.weight_shapes[name]:
                raise BadRequest(f"weight {name!r} has shape {tuple(t.shape)}, the served model's is {self.weight_shapes[name]}")
        missing = sorted(set(self.weight_shapes) - seen)
        if missing:
            raise BadRequest(f"an update must carry every weight; missing {len(missing)}: {missing[:5]}")
        return named

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)
        if self.weights_dir is not None:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.weights_dir, marker_name(self.instance)))

    # ------------------------------------------------------------------ engine thread
    def _engine_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            batch = [job]
            if isinstance(job, _Generate) and job.merge_key() is not None and self.coalesce_seconds > 0:
                time.sleep(self.coalesce_seconds)  # let the other ranks' shares of this batch arrive
            while True:  # everything queued now, in order
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._run_guarded(batch)
                    return
                batch.append(nxt)
            self._run_guarded(batch)

    def _run_guarded(self, jobs: list) -> None:
        """``_run``, and whatever escapes it answers the requests still waiting (the engine
        thread must outlive any one request, or every later client would wait forever)."""
        try:
            self._run(jobs)
        except Exception as e:  # noqa: BLE001
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(RuntimeError(f"the server failed on this request: {type(e).__name__}: {e}"))

    def _run(self, jobs: list) -> None:
        """Run ``jobs`` in order, merging runs of consecutive generations with one merge key."""
        i = 0
        while i < len(jobs):
            job = jobs[i]
            if isinstance(job, _Update):
                self._update(job)
                i += 1
                continue
            group = [job]
            key = job.merge_key()
            j = i + 1
            while key is not None and j < len(jobs) and isinstance(jobs[j], _Generate) and jobs[j].merge_key() == key:
                group.append(jobs[j])
                j += 1
            self._generate(group)
            i = j

    def _update(self, job: _Update) -> None:
        try:
            self.sampler.update_weights(job.named)
        except Exception as e:  # noqa: BLE001 - reported to the client; the engine needs a good reload now
            self.weights_error = f"{type(e).__name__}: {e}"
            job.future.set_exception(RuntimeError(f"the weight update failed: {self.weights_error}"))
            return
        self.weights_error = None
        self.weights_version += 1
        job.future.set_result({"instance": self.instance, "weights_version": self.weights_version})

    def _generate(self, group: list[_Generate]) -> None:
        if self.weights_error is not None:
            error = RuntimeError(f"the last weight update failed ({self.weights_error}); push complete weights first")
            for job in group:
                job.future.set_exception(error)
            return
        first = group[0]
        prompts = [p for job in group for p in job.prompts]
        seeds = None if first.prompt_seeds is None else [s for job in group for s in job.prompt_seeds]
        try:
            extra = {"prompt_seeds": seeds} if seeds is not None else {}
            batch = self.sampler.generate(prompts, group_size=first.group_size, sampling=first.sampling, **extra)
        except Exception as e:  # noqa: BLE001 - each request gets its answer, the server stays up
            if len(group) > 1:
                for job in group:  # find the culprit: run them one by one
                    self._generate([job])
                return
            first.future.set_exception(e if isinstance(e, ValueError) else RuntimeError(f"{type(e).__name__}: {e}"))
            return
        self.engine_calls += 1
        G = first.group_size
        start = 0
        for k, job in enumerate(group):
            n = len(job.prompts) * G
            ids = batch.completion_ids[start : start + n]
            logp = batch.completion_logp[start : start + n]
            lengths = [len(c) for c in ids]
            stats = RolloutStats(
                prompts=len(job.prompts), samples=n, generated_tokens=sum(lengths), seconds=batch.stats.seconds,
                # the engine's cache counters cover the merged call: reported once, on its first request
                prefill_tokens_computed=batch.stats.prefill_tokens_computed if k == 0 else 0,
                prefix_tokens_reused=batch.stats.prefix_tokens_reused if k == 0 else 0,
                prefix_cache_hit_rate=batch.stats.prefix_cache_hit_rate,
            )
            flat_ids = torch.tensor([t for c in ids for t in c], dtype=torch.int32)
            flat_logp = torch.cat([x.float() for x in logp]) if logp else torch.zeros(0)
            job.future.set_result({
                "instance": self.instance, "weights_version": self.weights_version, "lengths": lengths,
                "token_ids": encode_array(flat_ids), "logp": encode_array(flat_logp),
                "finish_reasons": batch.finish_reasons[start : start + n], "stats": asdict(stats),
                "merged_requests": len(group),
            })
            start += n


MODEL_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "tie_word_embeddings")


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]] | None:
    """Name -> shape of every tensor in the folder's safetensors files (None: none there)."""
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def engine_summary(vllm_config: Any) -> dict[str, Any]:
    """What the engine runs with (a client can check that its --engine-arg took effect)."""
    return {
        "dtype": str(vllm_config.model_config.dtype).removeprefix("torch."),
        "max_num_seqs": vllm_config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
        "enable_chunked_prefill": vllm_config.scheduler_config.enable_chunked_prefill,
        "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
        "block_size": vllm_config.cache_config.block_size,
    }


def model_summary(config: Any) -> dict[str, Any]:
    """The architecture fields a trainer's policy must share with the served model."""
    return {k: getattr(config, k, None) for k in MODEL_FIELDS}


# ---------------------------------------------------------------------- HTTP
def _handler(service: SamplerService, quiet: bool):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            if not quiet:
                super().log_message(format, *args)

        def _send(self, code: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode("utf-8")
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            length = self.headers.get("Content-Length")
            if length is None:
                raise BadRequest("Content-Length is required")
            return self.rfile.read(int(length))

        def _answer(self, work) -> None:
            try:
                self._send(200, work())
            except ValueError as e:  # BadRequest, and the sampler's own input checks
                self._send(400, {"error": str(e)})
            except Exception as e:  # noqa: BLE001 - the client gets the message; the server stays up
                self._send(500, {"error": f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else str(e)})

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = urllib.parse.urlparse(self.path).path
            if path in ("/info", "/health"):
                self._answer(service.info)
            else:
                self._send(404, {"error": f"no such endpoint {path}"})

        def do_POST(self) -> None:  # noqa: N802
            url = urllib.parse.urlparse(self.path)
            if url.path == "/generate":
                self._answer(lambda: service.generate(_json(self._body())))
            elif url.path == "/update_weights":
                def work():
                    q = urllib.parse.parse_qs(url.query)
                    try:
                        upload, part, last = q["upload"][0], int(q["part"][0]), q["last"][0] == "1"
                    except (KeyError, ValueError):
                        raise BadRequest("update_weights needs ?upload=ID&part=K&last=0|1") from None
                    file = q.get("file", [None])[0]
                    return service.upload(upload, part, last, self._body(), file=file)

                self._answer(work)
            else:
                self._body()
                self._send(404, {"error": f"no such endpoint {url.path}"})

    return Handler


def _json(body: bytes) -> Any:
    try:
        return json.loads(body.decode("utf-8"))
    except ValueError:
        raise BadRequest("the body is not JSON") from None


def serve(service: SamplerService, host: str = "127.0.0.1", port: int = 8000, *, quiet: bool = True) -> ThreadingHTTPServer:
    """An HTTP server for ``service`` bound to ``host:port`` (port 0: a free one); call
    ``serve_forever()`` on it."""
    server = ThreadingHTTPServer((host, port), _handler(service, quiet))
    server.daemon_threads = True
    return server


# ---------------------------------------------------------------------- CLI
def add_server_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", required=True, help="a local Hugging Face model folder (config + safetensors)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed when ready)")
    parser.add_argument("--dtype", default="float32", help="engine dtype (float32, bfloat16, float16)")
    parser.add_argument("--block-size", type=int, default=32, help="KV-cache block size (CPU: a multiple of 32)")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion (default: the model's)")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="KV-cache size in GiB (CPU default 0.25; GPU default: vLLM's sizing)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="vLLM's share of GPU memory")
    parser.add_argument("--seed", type=int, default=0, help="engine seed (requests without seeds)")
    parser.add_argument("--weights-dir", default=None,
                        help="a directory (e.g. /dev/shm/fastrl) where trainers on this host leave weight updates as files "
                             "instead of sending them over HTTP (several times faster); clients find it themselves")
    parser.add_argument("--coalesce-ms", type=float, default=20.0,
                        help="wait this long for other ranks' requests to batch with a seeded one (0: never wait)")
    parser.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                        help="any other vllm.LLM argument, repeatable (e.g. tensor_parallel_size=2, max_num_seqs=128, "
                             "enable_chunked_prefill=true); values are read as JSON when they parse")
    parser.add_argument("--verbose", action="store_true", help="log every HTTP request")
    return parser


# set by fastrl itself (the sampler's contract depends on them): not overridable
_FIXED_ENGINE_ARGS = ("model", "skip_tokenizer_init", "logprobs_mode", "logits_processors", "worker_extension_cls",
                      "disable_log_stats")


def parse_engine_args(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings as ``vllm.LLM`` keyword arguments; a value is read as JSON when it
    parses (numbers, true/false, lists, objects), else kept as a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key.isidentifier():
            raise ValueError(f"--engine-arg takes KEY=VALUE (a vllm.LLM argument), got {item!r}")
        if key in _FIXED_ENGINE_ARGS:
            raise ValueError(f"--engine-arg {key} is set by fastrl vllm-server itself")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def run_server(args: argparse.Namespace) -> int:
    from fastrl.rollout.vllm import VLLMGroupSampler

    try:
        kwargs = parse_engine_args(args.engine_arg or [])
    except ValueError as e:
        print(f"fastrl vllm-server: error: {e}", file=sys.stderr)
        return 2
    if args.kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    if args.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    # fail on a busy port before the (slow) engine start
    try:
        server = serve(None, args.host, args.port, quiet=not args.verbose)  # type: ignore[arg-type]
    except OSError as e:
        print(f"fastrl vllm-server: error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    sampler = VLLMGroupSampler(
        args.model, dtype=args.dtype, block_size=args.block_size, max_model_len=args.max_model_len, seed=args.seed, **kwargs
    )
    hf_config = sampler.llm.llm_engine.model_config.hf_config
    service = SamplerService(sampler, coalesce_seconds=args.coalesce_ms / 1000.0, weight_shapes=checkpoint_shapes(args.model),
                             tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
                             weights_dir=args.weights_dir)
    server.RequestHandlerClass = _handler(service, quiet=not args.verbose)
    host, port = server.server_address[:2]

    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"fastrl vllm-server: ready at http://{host}:{port} (model {args.model}, vocab {sampler.vocab_size}, "
          f"max length {sampler.max_model_len})", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        service.close()
        sampler.close()
    print("fastrl vllm-server: stopped", file=sys.stderr, flush=True)
    return 0
