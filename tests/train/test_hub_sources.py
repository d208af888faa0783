"""A model or dataset named by a hub id that is not here: refused in one line and seconds
(fastrl/train/run/hub.py), never a minute of retries and a traceback (issue 39)."""

from __future__ import annotations

import pytest

from fastrl.errors import InputError
from fastrl.train.run.hub import HUB_PROBE_SECONDS, check_hub_source, hub_offline, probe_hub


def _no_network(*args):
    raise AssertionError(f"the hub was asked {args} although HF_HUB_OFFLINE is set")


def test_offline_refuses_a_name_not_in_the_cache_without_any_network_attempt():
    with pytest.raises(InputError, match=r"^model 'my-model' is not a local path and not in the hub cache, and HF_HUB_OFFLINE"):
        check_hub_source("model", "my-model", environ={"HF_HUB_OFFLINE": "1"}, probe=_no_network, cached=lambda *a: False)
    # in the cache: fine, still without the network
    check_hub_source("model", "org/cached", environ={"HF_HUB_OFFLINE": "1"}, probe=_no_network, cached=lambda *a: True)
    assert hub_offline({"TRANSFORMERS_OFFLINE": "true"}) and not hub_offline({"HF_HUB_OFFLINE": "0"}) and not hub_offline({})


def test_a_local_path_is_never_looked_up(tmp_path):
    check_hub_source("model", str(tmp_path), environ={"HF_HUB_OFFLINE": "1"}, probe=_no_network, cached=_no_network)
    check_hub_source("model", None, probe=_no_network, cached=_no_network)


def test_online_the_hub_is_asked_once_with_the_short_timeout():
    asked = []

    def probe(repo_id, repo_type, timeout):
        asked.append((repo_id, repo_type, timeout))
        return "not found" if repo_id == "nobody/nothing" else None

    check_hub_source("model", "org/exists", environ={}, probe=probe, cached=lambda *a: False)
    with pytest.raises(InputError, match=r"^dataset 'nobody/nothing' is not a local path and the Hugging Face hub not found"):
        check_hub_source("dataset", "nobody/nothing", repo_type="dataset", environ={}, probe=probe, cached=lambda *a: False)
    assert asked == [("org/exists", "model", HUB_PROBE_SECONDS), ("nobody/nothing", "dataset", HUB_PROBE_SECONDS)]


def test_the_real_probe_returns_within_its_bound_whatever_the_network():
    """On a machine without the hub (this one, CI) the real request fails fast; with the hub it
    answers. Either way it returns (the probe's thread is joined with the timeout)."""
    answer = probe_hub("fastrl-test/surely-not-a-repo-0d9f", "model", timeout=1.0)
    assert answer is not None and (answer == "not found" or answer.startswith("cannot be reached"))


def test_fastrl_train_with_a_bare_name_offline_is_one_line(tmp_path, monkeypatch, capsys):
    from fastrl.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["train", "--model", "my-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fastrl train: error: model 'my-model' is not a local path") and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "runs").exists()  # refused before the output folder is made


def test_a_resumed_run_reads_its_model_from_the_checkpoint_and_only_its_datasets_are_checked():
    from types import SimpleNamespace

    from fastrl.train.run.hub import check_run_sources

    asked = []

    def probe(repo_id, repo_type, timeout):
        asked.append(repo_id)
        return None

    cfg = SimpleNamespace(model="org/model", tokenizer=None, critic_init=None, dataset="org/data", eval_dataset=None, resume="latest")
    check_run_sources(cfg, environ={}, probe=probe, cached=lambda *a: False)
    assert asked == ["org/data"]
    cfg.resume = None
    check_run_sources(cfg, environ={}, probe=probe, cached=lambda *a: False)
    assert asked == ["org/data", "org/model", "org/data"]
