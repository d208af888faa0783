"""A model or dataset named by a hub id that is not on this machine: reachable, or one line.

``transformers``/``datasets`` given a name that is neither a local folder nor in the local
cache go to the Hugging Face hub, and without a network they retry for most of a minute and
end in a long traceback. ``check_hub_source`` decides first, in seconds: a name in the local
cache is fine; with ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``/``HF_DATASETS_OFFLINE``)
set, a name not in the cache is an ``InputError`` without any network attempt; otherwise one
request to the hub, bounded by ``HUB_PROBE_SECONDS`` (a thread, so a DNS lookup that hangs is
bounded too), says whether it exists and can be reached.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

from fastrl.errors import InputError

__all__ = ["HUB_PROBE_SECONDS", "OFFLINE_VARIABLES", "check_hub_source", "hub_offline", "probe_hub"]

HUB_PROBE_SECONDS = 5.0
"""The longest the hub may take to answer whether a name exists before the run is refused."""
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_offline(environ: dict[str, str] | None = None) -> bool:
    """Whether the environment forbids the hub (any of ``OFFLINE_VARIABLES`` set to a true value)."""
    env = os.environ if environ is None else environ
    return any(env.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in OFFLINE_VARIABLES)


def _cached(repo_id: str, repo_type: str) -> bool:
    """Whether the local hub cache holds the repo (no network)."""
    try:
        from huggingface_hub import scan_cache_dir, try_to_load_from_cache
    except ImportError:
        return False
    if repo_type == "model":
        found = try_to_load_from_cache(repo_id, "config.json")
        return isinstance(found, str)
    try:
        return any(repo.repo_id == repo_id and repo.repo_type == repo_type for repo in scan_cache_dir().repos)
    except Exception:  # noqa: BLE001 - no cache folder, or an unreadable one: nothing cached
        return False


def probe_hub(repo_id: str, repo_type: str, timeout: float) -> str | None:
    """One request to the hub about ``repo_id``: None when it exists, else why not ("not
    found", or why it could not be reached). At most ``timeout`` seconds, however the
    network fails."""
    answer: list[str | None] = []

    def ask() -> None:
        try:
            from huggingface_hub import HfApi
            from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

            try:
                HfApi().repo_info(repo_id, repo_type=repo_type, timeout=timeout)
                answer.append(None)
            except GatedRepoError:
                answer.append(None)  # it exists; the download says what access it needs
            except RepositoryNotFoundError:
                answer.append("not found")
        except Exception as error:  # noqa: BLE001 - any network failure is "cannot be reached"
            answer.append(f"cannot be reached ({type(error).__name__})")

    worker = threading.Thread(target=ask, daemon=True, name="fastrl-hub-probe")
    worker.start()
    worker.join(timeout)
    return answer[0] if answer else f"cannot be reached (no answer in {timeout:g} s)"


def check_hub_source(name: str, source: str | None, *, repo_type: str = "model", environ: dict[str, str] | None = None,
                     probe: Callable[[str, str, float], str | None] = probe_hub, cached: Callable[[str, str], bool] = _cached) -> None:
    """Refuse, in one line and seconds, ``source`` (the ``name`` option's value) when it is not
    a local path, not in the local cache, and the hub is off (``HF_HUB_OFFLINE``) or does not
    have it or cannot be reached. ``probe`` and ``cached`` are the network and cache look-ups
    (parameters for tests)."""
    if source is None or os.path.exists(os.path.expanduser(source)):
        return
    if cached(source, repo_type):
        return
    local = f"a local {'folder' if repo_type == 'model' else 'file or folder'} is written as a path ('./{source}')"
    if hub_offline(environ):
        set_ = next(v for v in OFFLINE_VARIABLES if hub_offline({v: (environ or os.environ).get(v, "")}))
        raise InputError(f"{name} {source!r} is not a local path and not in the hub cache, and {set_} is set (no download): "
                         f"{local}")
    why = probe(source, repo_type, HUB_PROBE_SECONDS)
    if why is not None:
        raise InputError(f"{name} {source!r} is not a local path and the Hugging Face hub {why}: {local}, a hub id as "
                         "'org/name' (set HF_HUB_OFFLINE=1 to use only the local cache)")


def check_run_sources(cfg: Any, **hooks: Any) -> None:
    """``check_hub_source`` on a run's model, tokenizer, critic and datasets (a resumed run's
    checkpoint holds the policy, its tokenizer and the critic: only its datasets are read)."""
    models = () if getattr(cfg, "resume", None) else (("model", "model"), ("tokenizer", "model"), ("critic_init", "model"))
    for name, repo_type in (*models, ("dataset", "dataset"), ("eval_dataset", "dataset")):
        check_hub_source(name, getattr(cfg, name, None), repo_type=repo_type, **hooks)
