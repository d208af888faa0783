"""``GroupSampler`` on a shared vLLM server: ``VLLMServerSampler(url)``.

The server is ``fastrl vllm-server --model DIR`` (``fastrl.rollout.vllm_server``), a
``VLLMGroupSampler`` behind a small HTTP API, started by the user on a machine (or GPU) of
its own. This client needs neither vLLM nor a GPU: it sends token ids and sampling settings,
receives completions and the sampler's log-probs, and pushes new weights after each update.

Wire format (HTTP/1.1, JSON unless noted)
-----------------------------------------
- ``GET /info``: vocabulary size, maximum length, eos/pad ids, block size, the server's
  instance id and its weights version.
- ``POST /generate``: ``{"prompts", "group_size", "sampling": SamplingConfig fields,
  "prompt_seeds"}``; the answer carries the completions as little-endian int32/float32
  arrays (base64) with their lengths, the finish reasons, ``RolloutStats`` and the weights
  version the samples were drawn with.
- ``POST /update_weights?upload=ID&part=K&last=0|1``: the body is a safetensors file of
  some of the weights (parts of at most ``chunk_bytes`` keep the client's extra memory
  bounded); or, with ``&file=NAME`` and an empty body, the part is the file ``NAME`` in the
  server's ``--weights-dir`` (written there by a client on the same host). When the last part arrives the server checks the whole set against its
  checkpoint (every name once, shapes, floating dtypes), loads it into the engine, resets
  the prefix cache and answers with the new weights version.

Errors come back as ``{"error": message}``: 400 for bad input (raised here as
``ValueError``), 500 for a failure inside the engine (``RuntimeError``). An unreachable
server is a ``ConnectionError`` naming the URL.

Safety checks
-------------
Every answer names the server's instance (a random id per server start) and its weights
version (one more per completed upload). After ``update_weights`` the client expects the
version it was given; a generation drawn with other weights -- another trainer pushed its
own, or the server restarted with the weights on disk -- raises ``RuntimeError`` instead of
training on samples from a policy that is not the trainer's. One trainer per server.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import http.client
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any, Iterable, Sequence

import torch

from fastrl.rollout.base import RolloutBatch, RolloutStats, SamplingConfig, validate_prompt_seeds, validate_prompts

__all__ = ["VLLMServerSampler", "ServerError", "ServerTimeout", "ServerUnavailable"]

DEFAULT_CHUNK_BYTES = 512 << 20


def marker_name(instance: str) -> str:
    """The file a server with ``--weights-dir`` keeps there: a client that sees it shares the
    server's filesystem."""
    return f".fastrl-vllm-server-{instance}"


class ServerError(RuntimeError):
    """The server failed while handling a request (HTTP 500); its message is included."""


class ServerUnavailable(ConnectionError):
    """Nothing answers at the server's address (not started, stopped, or killed)."""


class ServerTimeout(TimeoutError):
    """A request took longer than the client's ``timeout``."""


_WIRE_DTYPES = {torch.int32: "<i4", torch.float32: "<f4"}


def encode_array(t: torch.Tensor) -> str:
    """A 1-D int32/float32 tensor as base64 of its little-endian bytes (exact, and far
    smaller and faster than JSON numbers for a batch of long completions)."""
    import numpy as np

    return base64.b64encode(np.ascontiguousarray(t.numpy(), dtype=_WIRE_DTYPES[t.dtype]).tobytes()).decode("ascii")


def decode_array(text: str, dtype: torch.dtype) -> torch.Tensor:
    import numpy as np

    raw = base64.b64decode(text.encode("ascii"))
    return torch.from_numpy(np.frombuffer(raw, dtype=_WIRE_DTYPES[dtype]).astype(_WIRE_DTYPES[dtype][1:]).copy())


def sampling_to_json(sampling: SamplingConfig) -> dict[str, Any]:
    out = dataclasses.asdict(sampling)
    out["stop_token_ids"] = list(sampling.stop_token_ids)
    return out


def sampling_from_json(data: Any) -> SamplingConfig:
    if not isinstance(data, dict):
        raise ValueError("sampling must be an object of SamplingConfig fields")
    names = {f.name for f in dataclasses.fields(SamplingConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown sampling fields {unknown}")
    return SamplingConfig(**data)


class VLLMServerSampler:
    """``GroupSampler`` on a running ``fastrl vllm-server`` (see the module docstring).

    Args:
        url: the server, e.g. ``http://127.0.0.1:8000``.
        timeout: seconds one request (a generation, a weights part) may take before the
            client gives up with ``TimeoutError``; a hung server never hangs the trainer.
        connect_timeout: seconds to keep retrying a refused connection at start (a server
            that is still loading its model).
        chunk_bytes: largest weights part per request.
        weights_transport: how ``update_weights`` sends the weights. ``http``: in the request
            bodies. ``file``: as safetensors files in the server's ``--weights-dir`` (the
            server reads them from there: several times faster on one host, e.g. with
            ``/dev/shm``). ``auto`` (default): ``file`` when the server has a weights
            directory and this process sees the server's marker file in it (the same
            filesystem), else ``http``.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 1800.0,
        connect_timeout: float = 30.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        weights_transport: str = "auto",
    ) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"the vLLM server URL must look like http://host:port, got {url!r}")
        if not timeout > 0 or not connect_timeout >= 0 or not (isinstance(chunk_bytes, int) and chunk_bytes > 0):
            raise ValueError("timeout must be > 0, connect_timeout >= 0 and chunk_bytes a positive int")
        if weights_transport not in ("auto", "http", "file"):
            raise ValueError(f"weights_transport must be auto, http or file, got {weights_transport!r}")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.chunk_bytes = chunk_bytes
        info = self._wait_for_server(connect_timeout)
        self.info = info
        self.vocab_size: int = int(info["vocab_size"])
        self.max_model_len: int = int(info["max_model_len"])
        self.eos_token_ids: tuple[int, ...] = tuple(int(t) for t in info["eos_token_ids"])
        self.pad_token_id: int = int(info["pad_token_id"])
        self.block_size: int = int(info["block_size"])
        self.prefix_caching: bool = bool(info["prefix_caching"])
        self.instance: str = str(info["instance"])
        # None until this client pushes weights: then every generation must carry this version
        self.expected_version: int | None = None
        served_dir = info.get("weights_dir")
        shared = served_dir is not None and os.path.exists(os.path.join(served_dir, marker_name(self.instance)))
        if weights_transport == "file" and not shared:
            raise ValueError(
                f"weights_transport='file' needs a server started with --weights-dir on this machine's filesystem "
                f"(the server at {self.url} has weights_dir={served_dir!r}, and its marker file is not visible here)"
            )
        # where update_weights writes its files (None: the weights go in the request bodies)
        self.weights_dir: str | None = served_dir if shared and weights_transport != "http" else None

    # ------------------------------------------------------------------ transport
    def _request(self, method: str, path: str, body: bytes | None = None, content_type: str = "application/json") -> dict:
        req = urllib.request.Request(self.url + path, data=body, method=method)
        if body is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read().decode("utf-8")).get("error", "")
            except Exception:  # noqa: BLE001 - not our server's answer
                message = ""
            message = message or f"HTTP {e.code} {e.reason}"
            if e.code == 400:
                raise ValueError(f"vLLM server {self.url}: {message}") from None
            raise ServerError(f"vLLM server {self.url}{path} failed: {message}") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise ServerTimeout(f"vLLM server {self.url}{path}: no answer within {self.timeout:g} s") from None
            raise ServerUnavailable(
                f"no fastrl vLLM server answers at {self.url} ({e.reason}); start one with "
                "`fastrl vllm-server --model DIR --port PORT`"
            ) from None
        except TimeoutError:
            raise ServerTimeout(f"vLLM server {self.url}{path}: no answer within {self.timeout:g} s") from None
        except (ConnectionError, http.client.HTTPException) as e:  # the server went away mid-request
            raise ServerUnavailable(
                f"the vLLM server at {self.url} dropped the connection during {path.split('?')[0]} "
                f"({type(e).__name__}: {e}); is it still running?"
            ) from None
        try:
            return json.loads(payload.decode("utf-8"))
        except ValueError:
            raise ServerError(f"{self.url}{path} answered something that is not JSON: is it a fastrl vllm-server?") from None

    def _wait_for_server(self, connect_timeout: float) -> dict:
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                info = self._request("GET", "/info")
            except ServerUnavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)
                continue
            if info.get("server") != "fastrl-vllm":
                raise ServerError(f"{self.url} is not a fastrl vllm-server (its /info says {info!r:.200})")
            return info

    def _check_weights(self, answer: dict) -> None:
        if answer.get("instance") != self.instance:
            raise ServerError(
                f"the vLLM server at {self.url} restarted (instance {answer.get('instance')}, was {self.instance}): it runs the "
                "weights on its disk, not this trainer's; restart the run from its last checkpoint"
            )
        version = int(answer["weights_version"])
        if self.expected_version is not None and version != self.expected_version:
            raise ServerError(
                f"the vLLM server at {self.url} holds weights version {version}, this trainer pushed version "
                f"{self.expected_version}: another client updated its weights (one trainer per server)"
            )

    # ------------------------------------------------------------------ sampling
    def generate(
        self,
        prompts: list[list[int]],
        *,
        group_size: int,
        sampling: SamplingConfig,
        prompt_seeds: Sequence[int] | None = None,
    ) -> RolloutBatch:
        """``group_size`` completions per prompt, flat in group order, with the sampler's
        per-token log-probs (float32) and the server's prefix-cache statistics.

        ``prompt_seeds``: one seed per prompt (overrides ``sampling.seed``); a prompt's
        samples then depend on its seed alone, so the server may batch this request with
        other clients' (data-parallel ranks) without changing them. Bad input raises
        ``ValueError`` before anything is sent.
        """
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        prompts = validate_prompts(
            prompts, group_size=group_size, vocab_size=self.vocab_size, max_length=self.max_model_len,
            max_new_tokens=sampling.max_new_tokens,
        )
        seeds = validate_prompt_seeds(prompt_seeds, len(prompts))
        body = json.dumps({
            "prompts": prompts, "group_size": group_size, "sampling": sampling_to_json(sampling), "prompt_seeds": seeds,
        }).encode("utf-8")
        answer = self._request("POST", "/generate", body)
        self._check_weights(answer)
        lengths = [int(n) for n in answer["lengths"]]
        if len(lengths) != len(prompts) * group_size:
            raise ServerError(f"the server returned {len(lengths)} samples, expected {len(prompts) * group_size}")
        ids = decode_array(answer["token_ids"], torch.int32).long()
        logp = decode_array(answer["logp"], torch.float32)
        if ids.numel() != sum(lengths) or logp.numel() != sum(lengths):
            raise ServerError("the server's token and log-prob arrays do not match their lengths")
        completion_ids = [c.tolist() for c in ids.split(lengths)]
        completion_logp = list(logp.split(lengths))
        stats = RolloutStats(**answer["stats"])
        return RolloutBatch.from_samples(
            prompts, completion_ids, completion_logp, list(answer["finish_reasons"]),
            group_size=group_size, pad_token_id=self.pad_token_id, stats=stats,
        )

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Send every weight of the model (Hugging Face names, e.g. ``state_dict().items()``,
        any device and float dtype) in safetensors parts; the server reloads them into its
        engine and resets its prefix cache when the last part is in. Returns the server's new
        weights version, which every later generation must carry."""
        from safetensors.torch import save, save_file

        def parts() -> Iterable[dict[str, torch.Tensor]]:
            part: dict[str, torch.Tensor] = {}
            size = 0
            for name, t in named_tensors:
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
                # a private contiguous CPU copy: safetensors refuses tensors that share storage (tied weights)
                t = t.detach().to("cpu", copy=True).contiguous()
                if part and size + t.nbytes > self.chunk_bytes:
                    yield part
                    part, size = {}, 0
                part[str(name)] = t
                size += t.nbytes
            if part:
                yield part

        upload = uuid.uuid4().hex
        written: list[str] = []

        def send(index: int, part: dict[str, torch.Tensor], last: bool) -> dict:
            query = f"/update_weights?upload={upload}&part={index}&last={int(last)}"
            if self.weights_dir is None:
                return self._request("POST", query, save(part), "application/octet-stream")
            name = f"{upload}-{index}.safetensors"
            path = os.path.join(self.weights_dir, name)
            written.append(path)
            save_file(part, path)
            return self._request("POST", f"{query}&file={name}", b"", "application/octet-stream")

        try:
            # one part ahead: a part is sent once it is known whether it is the last
            pending: dict[str, torch.Tensor] | None = None
            index = 0
            for part in parts():
                if pending is not None:
                    send(index, pending, last=False)
                    index += 1
                pending = part
            if pending is None:
                raise ValueError("named_tensors is empty")
            answer = send(index, pending, last=True)
        finally:
            for path in written:
                with contextlib.suppress(OSError):
                    os.remove(path)
        if answer.get("instance") != self.instance:
            raise ServerError(f"the vLLM server at {self.url} restarted during the weight update")
        self.expected_version = int(answer["weights_version"])
        return self.expected_version

    def expect_weights_version(self, version: int) -> None:
        """Another process (data-parallel rank 0) pushed the weights: expect its version."""
        self.expected_version = int(version)

    def close(self) -> None:
        """Nothing to release: the server belongs to whoever started it."""
