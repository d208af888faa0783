"""A tiny Llama policy, a local character-level tokenizer, a prompt set and a rule reward for
end-to-end TRL runs on CPU (nothing is downloaded). Shared by tests/integrations/test_trl.py and
benchmarks/bench_trl_memory.py."""

from __future__ import annotations

import os

import torch

CHARS = list("abcdefghijklmnopqrstuvwxyz +=0123456789")


def build_tiny_llama(path: str, *, hidden_size: int = 32, num_layers: int = 2, vocab_pad: int = 0, seed: int = 0) -> str:
    """Write a randomly initialised Llama and its tokenizer to ``path``; returns ``path``.

    ``vocab_pad`` adds unused tokens to grow the vocabulary (the LM head) for memory benchmarks.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    for i in range(vocab_pad):
        vocab[f"<extra_{i}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


def prompt_dataset(n: int = 8):
    from datasets import Dataset

    words = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op", "qr", "st", "uv", "wx"]
    return Dataset.from_dict({"prompt": [f"{words[i % len(words)]} {i}=" for i in range(n)]})


def count_a_reward(completions, **kwargs):
    """Rule reward: number of 'a' characters plus a small length bonus (varies within a group)."""
    return [float(c.count("a")) + 0.1 * len(c) for c in completions]
