"""The embedded default: a built-in tokenizer, a verifiable arithmetic task and a tiny
causal LM built from a config -- everything ``fastrl train`` needs without a download.

- ``char_tokenizer()``: a character-level tokenizer (printable ASCII, newline, tab, plus
  ``<pad> <bos> <eos> <unk>`` and the chat-role markers ``<|system|> <|user|> <|assistant|>``)
  built in memory with ``tokenizers`` and wrapped as ``transformers.PreTrainedTokenizerFast``,
  with a chat template, so ``apply_chat_template`` and ``save_pretrained`` /
  ``AutoTokenizer.from_pretrained`` work as for any hub tokenizer.
- ``ArithmeticTask``: seeded problems such as ``"37+58="`` -> ``"95"`` with disjoint train and
  held-out sets (rows are dicts with ``prompt`` and ``answer``).
- ``tiny_model(tokenizer, ...)``: a Llama or Qwen2 causal LM from a config whose vocabulary,
  special-token ids and context length match the tokenizer and the task.
- ``DefaultTask``: the settings ``fastrl train`` uses with no arguments, and how they were chosen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "char_tokenizer",
    "ArithmeticTask",
    "exact_match_score",
    "tiny_model",
    "DefaultTask",
]

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK) + ROLE_TOKENS
"""Special tokens of the built-in tokenizer, in id order (``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ...)."""

# <bos>, then each message as <|role|>content (assistant turns end with <eos>), then
# <|assistant|> when a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` built in memory (no files, no download).

    Vocabulary: the 7 ``SPECIAL_TOKENS`` (ids 0-6), then the 95 printable ASCII characters,
    newline and tab (104 tokens). Other characters map to ``<unk>``. Encoding text adds
    ``<bos>`` in front (``add_special_tokens=False`` leaves it out); decoding concatenates the
    characters. The chat template renders ``<bos><|user|>37+58=<|assistant|>`` for one user
    message with ``add_generation_prompt=True``.
    """
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + chars)}
    # BPE without merges = one token per character, unknown characters -> <unk>; no
    # pre-tokenizer, so spaces are ordinary characters.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        padding_side="right",
    )
    return tokenizer


_OPERATIONS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


@dataclass(frozen=True)
class ArithmeticTask:
    """Integer arithmetic problems with one exact answer: ``"37+58="`` -> ``"95"``.

    Operands are drawn uniformly from ``[0, 10**digits)``; the operation uniformly from
    ``operations``. ``train_rows``/``heldout_rows`` come from one seeded draw of distinct
    problems, so the two sets never share a prompt.
    """

    digits: int = 2
    """Most digits per operand (operands are uniform in [0, 10**digits))."""
    operations: str = "+"
    """Operations to draw from, any of ``+``, ``-`` (answers may be negative), ``*``."""
    num_train: int = 2000
    """Training problems."""
    num_heldout: int = 200
    """Held-out problems (disjoint from the training ones)."""
    seed: int = 0
    """Seed of the problem draw."""

    def __post_init__(self) -> None:
        if not isinstance(self.digits, int) or isinstance(self.digits, bool) or not 1 <= self.digits <= 9:
            raise ValueError(f"digits must be an int in [1, 9], got {self.digits!r}")
        if not self.operations or any(op not in _OPERATIONS for op in self.operations) or len(set(self.operations)) != len(self.operations):
            raise ValueError(f"operations must be distinct characters among {''.join(_OPERATIONS)!r}, got {self.operations!r}")
        for name in ("num_train", "num_heldout"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.num_train + self.num_heldout > self.num_problems:
            raise ValueError(
                f"num_train + num_heldout = {self.num_train + self.num_heldout} exceeds the {self.num_problems} "
                f"distinct problems with digits={self.digits}, operations={self.operations!r}"
            )

    @property
    def num_problems(self) -> int:
        """How many distinct prompts the task has."""
        return len(self.operations) * (10**self.digits) ** 2

    @staticmethod
    def solve(a: int, op: str, b: int) -> str:
        return str(_OPERATIONS[op](a, b))

    def _draw(self) -> list[dict[str, str]]:
        rng = random.Random(self.seed)
        n = self.num_train + self.num_heldout
        base = 10**self.digits
        # distinct indices into the (op, a, b) grid, without building the whole grid
        picks = rng.sample(range(self.num_problems), n)
        rows = []
        for index in picks:
            op_index, rest = divmod(index, base * base)
            a, b = divmod(rest, base)
            op = self.operations[op_index]
            rows.append({"prompt": f"{a}{op}{b}=", "answer": self.solve(a, op, b)})
        return rows

    def train_rows(self) -> list[dict[str, str]]:
        """The training problems, as ``{"prompt", "answer"}`` dicts."""
        return self._draw()[self.num_heldout :]

    def heldout_rows(self) -> list[dict[str, str]]:
        """The held-out problems, as ``{"prompt", "answer"}`` dicts."""
        return self._draw()[: self.num_heldout]

    @property
    def max_prompt_chars(self) -> int:
        """Longest prompt in characters (two operands, an operation and ``=``)."""
        return 2 * self.digits + 2

    @property
    def max_answer_chars(self) -> int:
        """Longest answer in characters, a sign included."""
        top = 10**self.digits - 1
        return max(len(self.solve(a, op, b)) for op in self.operations for a in (0, top) for b in (0, top))


def exact_match_score(prompts: list, completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where the completion, stripped of surrounding whitespace, equals the answer; else 0.0."""
    return [1.0 if c.strip() == str(a).strip() else 0.0 for c, a in zip(completions, answers)]


def tiny_model(
    tokenizer,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 64,
    arch: str = "llama",
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> torch.nn.Module:
    """A randomly initialised causal LM (``LlamaForCausalLM`` or ``Qwen2ForCausalLM``) that
    matches ``tokenizer``: ``vocab_size = len(tokenizer)``, and its bos/eos/pad ids.

    ``max_position_embeddings`` bounds prompt + completion length (the sampler checks it);
    ``intermediate_size`` defaults to ``4 * hidden_size``, ``kv_heads`` to ``heads``. The
    initialisation is seeded (``seed``) and independent of the global RNG's later use.
    Dropout is 0, so a forward is deterministic on CPU.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")
    if hidden_size % heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of heads ({heads})")
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; generation could not stop")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config_kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    config = LlamaConfig(**config_kwargs) if arch == "llama" else Qwen2Config(**config_kwargs)
    with torch.random.fork_rng(devices=[]):  # seeded init on CPU; the caller's RNG is left as it was
        torch.manual_seed(seed)
        model = (LlamaForCausalLM if arch == "llama" else Qwen2ForCausalLM)(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad_id
    )
    return model


@dataclass(frozen=True)
class DefaultTask:
    """What ``fastrl train`` runs with no arguments (the embedded default).

    Contract: a run with these settings needs nothing but this machine (no download) and
    learns within a CPU budget: 2-digit addition with chat-formatted prompts
    (``<bos><|user|>37+58=<|assistant|>``, at most 9 tokens) and answers of 1-3 digits +
    ``<eos>``, on a 4-layer, 64-wide tiny Llama.

    Why these values: GRPO only improves a model that already has the procedure but still
    errs (from a model that gets almost nothing right, the groups are all wrong and carry
    no signal), and how long the SFT warm-up needs to reach that point varies with the
    seed. So the warm-up is *adaptive*: SFT until greedy accuracy on ``sft_probe_rows``
    training problems reaches ``sft_target_accuracy`` (checked every ``sft_check_every``
    steps), at most ``sft_max_steps`` steps; 2 layers rarely learn the carry in that budget.
    The exploratory measurements behind these choices (per-seed accuracies, learning rates
    tried, step costs) are recorded in ``benchmarks/results/default_task_selection_notes.md``;
    the held-out accuracy of the default run over 3 seeds is in
    ``benchmarks/results/default_train_3seeds_cpu.json``.
    """

    task: ArithmeticTask = field(default_factory=lambda: ArithmeticTask(digits=2, operations="+", num_train=5000, num_heldout=200))
    """The verifiable task (operand digits, operations, train/held-out sizes)."""
    hidden_size: int = 64
    """Width of the tiny model."""
    layers: int = 4
    """Decoder layers of the tiny model (2 layers rarely learn the carry in the warm-up budget)."""
    heads: int = 4
    """Attention heads of the tiny model."""
    arch: str = "llama"
    """Model family built from a config (``llama`` or ``qwen2``)."""
    max_position_embeddings: int = 32
    """Context length of the tiny model: enough for the chat-formatted prompt and answer."""
    sft_max_steps: int = 2000
    """Most SFT warm-up steps (teacher-forced cross-entropy on answer + eos)."""
    sft_target_accuracy: float = 0.3
    """The warm-up stops once greedy accuracy on the probe rows reaches this (GRPO does
    the rest; starting lower, the groups are mostly all-wrong and GRPO stalls)."""
    sft_check_every: int = 50
    """SFT steps between probe evaluations."""
    sft_probe_rows: int = 100
    """Training problems the probe evaluates (greedy), never held-out ones."""
    sft_lr: float = 3e-3
    """SFT AdamW learning rate (constant after ``sft_warmup_steps``)."""
    sft_warmup_steps: int = 20
    """Linear learning-rate warm-up of the SFT stage."""
    sft_batch_size: int = 64
    """Problems per SFT step (64 rather than 32: the probe target is reached in fewer steps;
    see ``benchmarks/results/default_task_selection_notes.md``)."""
    max_new_tokens: int = 6
    """Completion budget: the longest answer (3 digits) plus ``<eos>`` and 2 tokens of slack."""
    grpo_lr: float = 5e-4
    """GRPO AdamW learning rate (the largest of those tried that rose steadily; see
    ``benchmarks/results/default_task_selection_notes.md``)."""
    grpo_prompts_per_step: int = 16
    """Prompts per GRPO step."""
    grpo_group_size: int = 8
    """Samples per prompt."""
    temperature: float = 1.0
    """Sampling temperature of the GRPO rollouts."""
    seed: int = 0
    """Seed of the model initialisation and the SFT data order."""
