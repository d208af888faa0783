"""``TrainConfig``: every option of ``fastrl train``, one documented field each.

An algorithm preset fills the fields left at ``None`` (loss settings, advantage mode,
dynamic sampling, critic); anything set explicitly wins. The presets map onto the op-level
presets (``PolicyLossConfig.preset`` and ``group_advantages`` modes): no formula is
written twice.

The command line (``fastrl train --help``) is generated from this dataclass by
jsonargparse, which also reads a YAML file (``--config run.yaml``) and rejects unknown
keys; the resolved configuration is written beside every run as ``config.yaml``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

from fastrl.agents.driver import AgentConfig
from fastrl.agents.tools import CALL_FORMATS
from fastrl.config import KLEstimator, LossAgg, PolicyLossConfig, Surrogate
from fastrl.errors import InputError
from fastrl.reference.advantages import GroupMode
from fastrl.reference.turn_advantages import NORMS, TURN_ADVANTAGE_MODES
from fastrl.rollout.hf import DECODE_MODES
from fastrl.train.correction import ROLLOUT_CORRECTIONS, RolloutCorrectionMode
from fastrl.train.reference_policy import REFERENCE_OFFLOADS
from fastrl.train.sft import SFT_LAYOUTS

_FLOAT32_MAX = 3.4028234663852886e38
"""Largest finite float32: a float option beyond it overflows the first tensor it enters."""
_MAX_SEED = 2**32 - 1
"""Largest seed every generator accepts (NumPy's legacy seeding stops at 2**32 - 1)."""

TURN_MODES: tuple[str, ...] = tuple(m for m in TURN_ADVANTAGE_MODES if m != "broadcast")
"""The ``turn_advantages`` modes ``advantage_mode`` names (agent trajectories only). The op's
``broadcast`` (GRPO's episode advantage on every policy token) is what the group modes already
do on agent trajectories: it is ``advantage_mode grpo`` (``dr_grpo`` for F_norm = 1)."""
AdvantageMode = Literal[GroupMode, "gae", Literal[TURN_MODES]]  # type: ignore[valid-type]
"""``TrainConfig.advantage_mode``: a ``group_advantages`` mode, ``gae`` (critic + GAE), or a
turn mode (``TURN_MODES``: ``turn_advantages`` over the turns of agent trajectories)."""
TurnNorm = Literal[NORMS]  # type: ignore[valid-type]
"""F_norm of the turn modes: ``std`` (std + eps) or ``none`` (1)."""


@dataclass(frozen=True)
class AlgorithmPreset:
    """What an algorithm name means: the loss preset, the advantage estimator and the extras."""

    loss_preset: str
    """``PolicyLossConfig.preset`` name."""
    advantage: str
    """A ``group_advantages`` mode, or ``gae`` (critic + GAE)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    citation: str = ""
    turn_gamma: float = 1.0
    """Discount over turns of the turn modes' returns (``TrainConfig.turn_gamma``'s default)."""
    turn_coef: float = 1.0
    """``turn_discounted``: weight of the per-turn-index advantage (MT-GRPO's lambda)."""
    outcome_coef: float = 0.0
    """``turn_discounted``: weight of the episode (outcome) advantage (MT-GRPO: 1)."""
    final_turn_coef: Optional[float] = None
    """``turn_discounted``: weight of the per-turn-index advantage on a trajectory's final turn
    (MT-GRPO: 0, the final turn gets the outcome advantage alone); None: ``turn_coef``."""

    @property
    def kl_coef(self) -> float:
        """Default KL weight to the reference policy: the loss preset's (one default, kept in
        ``PolicyLossConfig.preset``; e.g. GRPO's 0.04)."""
        return float(PolicyLossConfig.preset_settings(self.loss_preset).get("kl_coef", PolicyLossConfig.kl_coef))


def _default_task():
    from fastrl.train.task import DefaultTask

    return DefaultTask()


ALGORITHM_PRESETS: dict[str, AlgorithmPreset] = {
    "grpo": AlgorithmPreset("grpo", "grpo", citation="Shao et al. 2024, arXiv:2402.03300"),
    "dr_grpo": AlgorithmPreset("dr_grpo", "dr_grpo", citation="Liu et al. 2025, arXiv:2503.20783"),
    "dapo": AlgorithmPreset("dapo", "grpo", dynamic_sampling=True, citation="Yu et al. 2025, arXiv:2503.14476"),
    "gspo": AlgorithmPreset("gspo", "grpo", citation="Zheng et al. 2025, arXiv:2507.18071"),
    "rloo": AlgorithmPreset("ppo", "rloo", citation="Ahmadian et al. 2024, arXiv:2402.14740"),
    "reinforce_pp": AlgorithmPreset("ppo", "reinforce_pp", citation="Hu 2025, arXiv:2501.03262"),
    "ppo": AlgorithmPreset("ppo", "gae", citation="Schulman et al. 2017; Ouyang et al. 2022"),
    # agent trajectories only (fastrl train --env): step-level credit without a critic
    "gigpo": AlgorithmPreset("grpo", "gigpo", turn_gamma=0.95, citation="Feng et al. 2025, arXiv:2505.10978"),
    "mt_grpo": AlgorithmPreset("grpo", "turn_discounted", turn_gamma=0.0, turn_coef=1.0, outcome_coef=1.0, final_turn_coef=0.0,
                               citation="Zeng et al. 2025, arXiv:2505.11821"),
}
ALGORITHMS: tuple[str, ...] = tuple(ALGORITHM_PRESETS)
"""The algorithm names: the presets' keys (one list)."""
Algorithm = Literal[ALGORITHMS]  # type: ignore[valid-type]  (the CLI's choices, derived from the presets)
CallFormat = Literal[CALL_FORMATS]  # type: ignore[valid-type]  (the tool-call formats fastrl.agents.tools parses)
SamplerDecode = Literal[DECODE_MODES]  # type: ignore[valid-type]  (HFGroupSampler's decode modes, one list)
SftLayout = Literal[SFT_LAYOUTS]  # type: ignore[valid-type]  (the warm-up's batch layouts, fastrl.train.sft)

AGENT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(AgentConfig))
"""The agent limits and policies: ``TrainConfig`` has one option per ``AgentConfig`` field, of
the same name and meaning (``None``: the environment's default), derived from this list."""


# Held-out prompts per evaluation on a user's dataset (TrainConfig.eval_prompts=None): at 64,
# a 79K-parameter Llama's first evaluation (greedy + 4 samples of up to 256 tokens) took 31 s
# on the project's loaded 2-core CPU, 84 s at 200 prompts (20 s per training step of 16 x 8).
DATASET_EVAL_PROMPTS = 64
DEFAULT_SAVE_EVERY_MINUTES = 10.0
"""``save_every_minutes`` of a run that sets none: a checkpoint at least every 10 minutes of
training (the embedded default's whole run is ~2 minutes on a CPU: its checkpoints are the one
after the warm-up and the last)."""
DEFAULT_RL_STEPS = 150
"""RL steps of a run that sets none (``TrainConfig.steps=None``), the built-in environments' too."""


@dataclass
class TrainConfig:
    """A fastrl training run. Defaults run the embedded task offline on a CPU."""

    # ------------------------------------------------------------------ algorithm
    algorithm: Algorithm = "grpo"
    """Preset: grpo (DeepSeekMath), dr_grpo (no length/std bias), dapo (clip-higher, token-mean,
    dynamic sampling), gspo (sequence-level ratio), rloo (leave-one-out baseline), reinforce_pp
    (REINFORCE++: group baseline, batch whitening), ppo (critic + GAE); on agent trajectories
    (``--env``) also gigpo (GiGPO: episode + step-group advantages) and mt_grpo (MT-GRPO: outcome
    + per-turn advantages). Fields left unset below take the preset's values."""

    # ------------------------------------------------------------------ model and data
    model: Optional[str] = None
    """Policy: a local Hugging Face model directory or a hub id. None: the built-in tiny model
    (built from a config, random init, then the SFT warm-up) on the built-in task."""
    tokenizer: Optional[str] = None
    """Tokenizer directory or hub id (default: the model's; the built-in one for the built-in model)."""
    dataset: Optional[str] = None
    """Training prompts: a .jsonl/.json/.parquet file, a saved datasets directory or a hub id.
    None: the built-in arithmetic task."""
    dataset_split: str = "train"
    """Split to read from a hub dataset or a saved DatasetDict."""
    eval_dataset: Optional[str] = None
    """Held-out prompts (same formats). None: the built-in task's held-out set, or
    ``eval_fraction`` of ``dataset``."""
    eval_fraction: float = 0.05
    """Share of ``dataset`` held out for evaluation when ``eval_dataset`` is not given."""
    prompt_column: str = "prompt"
    """Column holding the prompt (a string, or a list of chat messages)."""
    chat_template: Optional[bool] = None
    """Apply the tokenizer's chat template to prompts (None: when the tokenizer has one)."""
    max_prompt_length: Optional[int] = None
    """Longest prompt in tokens (None: the model's context minus max_new_tokens). Longer prompts
    are an error before the first step unless ``drop_long_prompts``."""
    drop_long_prompts: bool = False
    """Drop (and count) prompts that do not fit instead of failing."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Training precision. auto: bf16 autocast on CUDA, float32 on CPU."""
    device: str = "auto"
    """auto (CUDA if available), cpu or cuda[:N]."""

    # ------------------------------------------------------------------ built-in task and warm-up
    task_digits: Optional[int] = None
    """Built-in task: most digits per operand of the arithmetic problems (None: DefaultTask's)."""
    task_operations: Optional[str] = None
    """Built-in task: operations to draw from, any of + - * (None: DefaultTask's)."""
    task_train_size: Optional[int] = None
    """Built-in task: number of training problems (None: DefaultTask's)."""
    task_eval_size: Optional[int] = None
    """Built-in task: number of held-out problems (None: DefaultTask's)."""
    model_hidden_size: Optional[int] = None
    """Built-in model: hidden size (None: DefaultTask's)."""
    model_layers: Optional[int] = None
    """Built-in model: decoder layers (None: DefaultTask's)."""
    model_heads: Optional[int] = None
    """Built-in model: attention heads, a divisor of the hidden size (None: DefaultTask's, or the
    built-in environment's)."""
    sft_steps: Optional[int] = None
    """Supervised warm-up steps before RL on the prompt/answer pairs (needs an ``answer`` column);
    with ``sft_target_accuracy``, the most steps. None: DefaultTask's for the built-in model, 0
    for a given model."""
    sft_target_accuracy: Optional[float] = None
    """Stop the warm-up once greedy accuracy (reward >= 1 with the answer column) on
    ``sft_probe_rows`` training prompts reaches this; None: DefaultTask's for the built-in
    model (GRPO needs groups that are sometimes right), else run all ``sft_steps``."""
    sft_warmup_steps: Optional[int] = None
    """Linear learning-rate warm-up of the supervised stage (None: DefaultTask's)."""
    sft_probe_rows: int = 100
    """Training prompts the warm-up's accuracy probe evaluates."""
    sft_check_every: Optional[int] = None
    """Warm-up steps between accuracy probes (None: DefaultTask's 50; a built-in environment's
    own, ``fastrl/train/env_task.py``). Logged: ``sft/probes``, and each probe in the warm-up's record."""
    sft_probe_sooner: bool = False
    """Probe the warm-up sooner as its accuracy nears the target: after a probe short of it, the
    next comes ``sft_check_every`` times the share of the target still missing
    (``fastrl.train.sft.ProbeSchedule``), so a steep learning curve is not overshot. Off by
    default: the warm-up then stops at the first probe noise lifts over the target, and on the
    built-in environments RL did no better from there (docs/agents.md)."""
    sft_lr: Optional[float] = None
    """Learning rate of the warm-up (None: DefaultTask's)."""
    sft_batch_size: Optional[int] = None
    """Rows per warm-up step (None: DefaultTask's)."""
    sft_answer_weight: Optional[float] = None
    """``--env`` warm-up: the loss weight of each demonstration's last assistant turn (the
    answer) relative to its earlier ones (the tool calls), in a weighted mean over policy
    tokens. None: the built-in environment's (``ENV_TASKS``, all 1 now), 1 for a user's
    environment. sql's main failure is a right query with a miscopied answer
    (``benchmarks/sql_failures.py``), which a larger weight stresses."""
    sft_layout: SftLayout = "auto"
    """How a warm-up batch runs, with the same loss and gradients: padded rows, or the trie of
    its examples (every prefix two share runs once: demonstrations share their system text,
    question templates and tool-call syntax). auto: the trie when it runs at most half the
    padded tokens (``fastrl.train.sft.SFT_TRIE_MIN_SAVING``): sql's and frozenlake's
    demonstrations, not the calculator's or the default task's. Logged as ``sft/trie_steps``."""

    # ------------------------------------------------------------------ rewards
    rewards: Optional[list[str]] = None
    """Reward functions: built-in names (exact_match, math, format) or ``module:function`` /
    ``path/file.py:function`` with TRL's signature ``f(prompts, completions, **columns)``.
    None: exact_match; with ``--env``: none (the environment's outcome reward alone), and the
    functions given score each whole trajectory, added to ``env_reward_weight`` times the
    environment's outcome (``fastrl/train/agent/score.py``)."""
    reward_weights: Optional[list[float]] = None
    """One weight per reward function (default: all 1)."""
    reward_timeout: float = 10.0
    """Seconds a reward call may take; past it the worker is killed and its samples score 0."""
    reward_workers: int = 2
    """Reward worker processes (0: run in the training process, no hard time limit)."""

    # ------------------------------------------------------------------ rollout
    sampler: Literal["hf", "vllm", "vllm-server"] = "hf"
    """hf: fastrl's shared-prefix HF sampler (the policy model itself, no copy). vllm: an
    in-process vLLM engine, weights pushed after every update. vllm-server: a running
    ``fastrl vllm-server`` at ``sampler_url`` (``--sampler vllm-server URL``), shared by every
    rank under torchrun; weights pushed before the first rollout and after every update."""
    sampler_url: Optional[str] = None
    """The vllm-server sampler's address, e.g. http://127.0.0.1:8000."""
    sampler_timeout: float = 1800.0
    """Seconds one request to the vllm-server (or one rollout of the ``async_steps`` sampler
    process) may take before the run stops with an error (also bounds, up to 30 s, the wait
    for a server that is still starting)."""
    sampler_decode: SamplerDecode = "eager"
    """The hf sampler's per-token decode step (``HFGroupSampler(decode=)``, one of
    ``fastrl.rollout.hf.DECODE_MODES``): eager (variable-shape ops), static (one static-shape
    step with preallocated KV buffers, run eagerly) or cuda_graph (that step captured in a CUDA
    graph once per rollout and replayed: needs a CUDA device). The same samples in every mode;
    used by the rollouts, the held-out evaluation and the ``async_steps`` sampler process.
    Only with sampler=hf."""
    async_steps: int = 0
    """Asynchronous training (AReaL, Fu et al. 2025, arXiv 2505.24298): the rollouts of the next
    ``async_steps`` steps are generated by a sampler process of its own (a copy of the policy,
    weights pushed after every update) while this step's update runs, so each rollout comes
    from a policy at most ``async_steps`` updates old (logged as ``async/staleness``). Needs
    ``sampler=hf`` on the CPU and a ``rollout_correction`` that sees the staleness
    (``decoupled``: decoupled PPO). With ``dynamic_sampling`` the refill rounds are sampled
    with the current weights. 0: the synchronous loop."""
    group_size: int = 8
    """Completions per prompt (G)."""
    prompts_per_step: int = 16
    """Prompts per RL step (ignored when ``prompt_token_budget`` is set)."""
    prompt_token_budget: Optional[int] = None
    """Batch prompts by tokens instead: (prompt + max_new_tokens) x group_size summed per step."""
    max_new_tokens: Optional[int] = None
    """Longest completion (None: DefaultTask's on the built-in task, else 256)."""
    temperature: float = 1.0
    """Sampling temperature (the loss uses the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = 0
    """Top-k sampling (0: off)."""
    dynamic_sampling: Optional[bool] = None
    """Drop groups whose rewards are all equal and sample more prompts to refill the batch
    (DAPO). None: the preset's choice."""
    rollout: Literal["independent", "tree"] = "independent"
    """independent: the group_size samples of a prompt are drawn each on its own. tree: they are
    the leaves of a tree (``fastrl.rollout.branch``; TreePO arXiv 2508.17445, TreeRL arXiv
    2506.11902): the prompt branches into tree_branches[0] continuations, each of those into
    tree_branches[1] at completion depth tree_depths[1], and so on; a shared segment is sampled
    once (the hf sampler forks its KV, vLLM reuses it through prefix caching) and
    ``rollout/generated_tokens`` counts it once. Group modes then add, on each segment's tokens,
    step_coef x its value (mean leaf reward below it) normalised among its siblings (turn_norm;
    docs/credit.md). With --env the tree branches at policy turns (tree_turns, not token depths):
    the siblings share the prompt, the earlier turns and their observations, each sibling's
    environment forked (its fork(), else a checked replay; fastrl.agents.branching); group modes
    and gae only. Not with async_steps or dynamic_sampling yet."""
    tree_branches: Optional[list[int]] = None
    """rollout=tree: children per node at each level; their product is group_size (None: 2 then
    group_size/2, or one level of group_size when it is odd)."""
    tree_depths: Optional[list[int]] = None
    """rollout=tree: the completion depth (tokens) of each level's branch point: 0, then strictly
    increasing, below max_new_tokens (None: evenly spaced, i * max_new_tokens / levels)."""
    tree_turns: Optional[list[int]] = None
    """rollout=tree with --env: the policy turn (0 = the first) at whose start each level of
    tree_branches branches, strictly increasing, below max_turns; leaves per row = the product
    of tree_branches = group_size (None: turns 0, 1, ..., one per level of tree_branches; both
    None: turns 0 and 1 with 2 then group_size/2, or turn 0 with group_size when it is odd, below
    4 or max_turns is 1). Siblings share the earlier turns and observations; each one's
    environment is forked (its fork(), else a replay checked against the recorded answers)."""
    max_resample_rounds: int = 3
    """Dynamic sampling: extra rollout rounds per step before training on what is there."""

    # ------------------------------------------------------------------ loss
    clip_low: Optional[float] = None
    """PPO clip epsilon_low (None: preset)."""
    clip_high: Optional[float] = None
    """PPO clip epsilon_high (None: preset; DAPO 0.28)."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages (None: off)."""
    loss_agg: Optional[LossAgg] = None
    """How per-token losses become one number (``PolicyLossConfig.loss_agg``; the choices are
    ``fastrl.config.LossAgg``; None: preset)."""
    surrogate: Optional[Surrogate] = None
    """Policy-gradient surrogate (``PolicyLossConfig.surrogate``; the choices are
    ``fastrl.config.Surrogate``), with that config's default hyperparameters; None: the
    algorithm's, PPO clip."""
    advantage_mode: Optional[AdvantageMode] = None
    """A ``group_advantages`` mode (``fastrl.reference.advantages.GroupMode``), ``gae`` (critic +
    GAE; on agent trajectories GAE over the policy tokens with per-turn rewards), or a turn mode
    for agent trajectories (``--env``): ``gigpo`` or ``turn_discounted``
    (``fastrl.ops.turn_advantages``). A group mode on agent trajectories gives every policy token
    its trajectory's advantage (the op's ``broadcast``). None: preset."""
    turn_gamma: Optional[float] = None
    """Turn modes: discount gamma in [0, 1] over turns of the turn returns
    G_k = sum_j gamma^(j-k) r_j (not GAE's per-token ``gamma``). None: preset (gigpo 0.95,
    mt_grpo 0, else 1)."""
    step_coef: float = 1.0
    """``gigpo``: GiGPO's omega, the weight of the step-group advantage added to the episode
    advantage (the paper's 1)."""
    turn_norm: TurnNorm = "std"
    """Turn modes: F_norm of both levels, ``std`` ((x - mean) / (std + eps)) or ``none``
    (x - mean)."""
    turn_coef: Optional[float] = None
    """``turn_discounted``: weight of the per-turn-index advantage (MT-GRPO's lambda). None:
    preset (1)."""
    outcome_coef: Optional[float] = None
    """``turn_discounted``: weight of the episode (outcome) advantage. None: preset (mt_grpo 1,
    else 0: the plain turn-discount form)."""
    final_turn_coef: Optional[float] = None
    """``turn_discounted``: weight of the per-turn-index advantage on each trajectory's final
    turn, in place of ``turn_coef``. None: preset (mt_grpo 0: the final turn gets the outcome
    advantage alone, as in MT-GRPO; else ``turn_coef``, every turn alike)."""
    kl_coef: Optional[float] = None
    """KL weight beta to the frozen reference policy (None: preset; 0 skips the reference model)."""
    kl_estimator: KLEstimator = "k3"
    """KL estimator (Schulman 2020)."""
    kl_in_reward: bool = False
    """Put the KL in the reward (PPO-RLHF: -beta * KL per token, outcome on the last token)
    instead of in the loss."""
    kl_target: Optional[float] = None
    """Adaptive KL controller target (Ziegler et al. 2019); None keeps beta fixed."""
    kl_horizon: int = 10000
    """Adaptive KL controller horizon in samples."""
    reference_offload: Literal[REFERENCE_OFFLOADS] = "auto"  # type: ignore[valid-type]
    """Where the reference policy's weights are between its passes (``fastrl.train.reference_policy``):
    disk (a file in output_dir/reference, mapped for the reference pass of each step; one process
    only), off (in memory), auto (disk on a single-process CPU run: one copy of the weights fewer
    at the update's memory peak, for one read of the file per step)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    rollout_correction: RolloutCorrectionMode = "none"
    """Sampler/trainer mismatch (``fastrl.train.correction``): none; is (truncated importance
    weights from the sampler's log-probs, ``is_cap``); bypass (use the sampler's log-probs as
    old log-probs); decoupled (decoupled PPO, AReaL arXiv 2505.24298, for ``async_steps``:
    ratio and clip against the trainer's policy, behaviour weight from the sampler's)."""
    is_cap: float = 2.0
    """Truncation of the importance weights of ``rollout_correction=is`` / ``decoupled``."""
    is_level: Literal["token", "sequence"] = "token"
    """Importance weights per token or per sequence."""

    # ------------------------------------------------------------------ update
    steps: Optional[int] = None
    """RL steps (rollout + update). None: ``DEFAULT_RL_STEPS`` (150; on the built-in task seed 0
    was still rising at 60; sql's 3 seeds rose more by 150 than by 100, docs/agents.md)."""
    max_seconds: Optional[float] = None
    """Budget: end the run once its RL steps (held-out evaluation excluded) have taken this many
    seconds, after the step that crosses it; the run then finishes as at its last step (final
    evaluation, model, summary). Counted from the start of this process's training (a resumed
    run starts a new count). None: no time limit."""
    max_generated_tokens: Optional[int] = None
    """Budget: end the run once its rollouts have generated this many completion tokens (all
    samples, dynamic-sampling rounds included), after the step that crosses it, as ``max_seconds``
    does. None: no token limit."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per epoch (the batch is split into this many mini-batches)."""
    shared_prefix: bool = True
    """Training forwards (policy, old, reference, critic) pack each group as one row
    [prompt | c1 | ... | cG] with a shared-prefix attention mask, so the prompt runs once per
    group; loss and gradients equal the padded batch's. False: right-padded [B, T] rows."""
    prefix_tree: typing.Union[bool, Literal["auto"]] = "auto"
    """Training forwards pack a micro-batch's samples as the trie of their tokens (prefix-tree
    attention): every prefix samples share runs once, however deep -- the prompt, and the
    earlier turns of step-wise samples or branches of one trajectory. Loss and gradients equal
    the padded batch's. true: always (takes precedence over shared_prefix); false: never;
    auto (with shared_prefix): each step's experience picks it when its samples share more than
    the prompt (``fastrl.train.batching.prefers_tree``: the trie saves at least
    ``TREE_MIN_SAVING`` of the tokens the group layout would run), logged as ``layout/tree``."""
    activation_checkpointing: Literal["auto", "off", "layer"] = "auto"
    """Recompute each decoder layer in the backward instead of keeping its activations (policy and
    critic). auto: on when a trajectory (longest prompt + max_new_tokens) reaches 2048 tokens."""
    offload_activations: bool = False
    """With checkpointing, keep each layer's saved input in (pinned) CPU memory during the
    backward instead of on the device: the only tensors checkpointing keeps are offloaded."""
    micro_batch_tokens: int = 8192
    """Tokens per forward/backward (packed tokens with shared_prefix, trie tokens with prefix_tree,
    else padded rows x length); whole groups go together. The update does not depend on it
    (global token counts)."""
    lr: Optional[float] = None
    """AdamW learning rate of the policy (None: DefaultTask's on the built-in model, else 1e-6)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up (optimizer steps)."""
    min_lr_ratio: float = 0.1
    """Cosine decay to this fraction of lr at the last step."""
    grad_clip: float = 1.0
    """Clip the gradient norm to this value (0: no clipping)."""

    # ------------------------------------------------------------------ critic (ppo)
    critic_init: Optional[str] = None
    """Critic initialisation: None copies the policy; a path loads a model directory (e.g. a GRPO
    run's final policy: hybrid GRPO -> PPO) or a fastrl critic checkpoint."""
    critic_lr: float = 5e-4
    """AdamW learning rate of the critic."""
    value_clip: Optional[float] = 0.2
    """Value-loss clip range (None: unclipped)."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_advantages: bool = True
    """PPO: whiten GAE advantages over the batch."""

    # ------------------------------------------------------------------ agents (fastrl train --env)
    env: Optional[str] = None
    """Train an agent on multi-turn, tool-using trajectories: a built-in environment
    (calculator, sql, frozenlake: rows, tiny model, warm-up and limits come with it) or a
    user's environment as ``module:Class`` (any zero-argument callable returning one; its rows
    come from ``dataset``). None: single-turn training on prompts."""
    env_workers: int = 2
    """Environment worker processes: each trajectory's environment lives in one; the steps of
    one turn run concurrently across them."""
    env_step_timeout: float = 10.0
    """Seconds one environment call (``reset`` or ``step``) may take; past it the worker is
    killed with its process group and replaced, and that trajectory ends (``failed_trajectories``)."""
    env_trajectory_timeout: float = 60.0
    """Seconds all environment calls of one trajectory may take together."""
    env_call_format: Optional[CallFormat] = None
    """How tool calls are written: ``hermes`` (``<tool_call>{json}</tool_call>``, the tools
    shown through the chat template) or ``compact`` (``name(args)``, for the built-in
    character tokenizer). None: compact with the built-in model, hermes otherwise."""
    env_max_repeated_calls: int = 3
    """A built-in environment ends a trajectory after the same tool call this many times in a
    row (``agent/stop/repeated_call``); 0: no limit."""
    env_reward_weight: float = 1.0
    """Weight of the environment's outcome reward in an agent run's reward: a trajectory's
    reward is ``env_reward_weight * outcome + sum_i reward_weights[i] * rewards[i](trajectory)``
    (0 with ``--rewards``: the functions alone)."""
    # one option per AgentConfig field (AGENT_FIELDS), same name, order and type; None: the
    # environment's default. --help shows AgentConfig's own docstring of each (cli._agent_help), and
    # tests/train/test_train_config.py holds this block equal to AgentConfig's fields.
    max_turns: Optional[int] = None
    """``AgentConfig.max_turns``; None: the environment's default."""
    max_turn_tokens: Optional[int] = None
    """``AgentConfig.max_turn_tokens``; None: the environment's default."""
    max_trajectory_tokens: Optional[int] = None
    """``AgentConfig.max_trajectory_tokens``; None: the environment's default."""
    max_observation_tokens: Optional[int] = None
    """``AgentConfig.max_observation_tokens``; None: the environment's default."""
    truncate_side: Optional[Literal["end", "start"]] = None
    """``AgentConfig.truncate_side``; None: the environment's default."""
    split_on_mismatch: Optional[bool] = None
    """``AgentConfig.split_on_mismatch``; None: the environment's default."""
    check_tokenization: Optional[bool] = None
    """``AgentConfig.check_tokenization``; None: the environment's default."""
    control_text: Optional[Literal["escape", "refuse", "allow"]] = None
    """``AgentConfig.control_text``; None: the environment's default."""
    failed_trajectories: Optional[Literal["zero", "mask"]] = None
    """``AgentConfig.failed_trajectories``; None: the environment's default."""

    # ------------------------------------------------------------------ evaluation, logging, checkpoints
    eval_every: int = 25
    """Held-out evaluation every N steps (and before the first and after the last); 0: off."""
    eval_prompts: Optional[int] = None
    """Held-out prompts per evaluation (None: 200 on the built-in task; 64 on a dataset, so the
    evaluation before the first step of a real model, greedy + pass@k samples of up to
    max_new_tokens each, stays well under a minute on a CPU)."""
    pass_k: int = 4
    """pass@k of the evaluation (k samples at the training temperature); 1: greedy accuracy only."""
    output_dir: Optional[str] = None
    """Where metrics, samples, checkpoints and the final model go. None: ``runs/<task>`` (``runs/default``,
    ``runs/calculator``, a dataset's name), or ``runs/<task>-2``, ``-3``, ... when it already holds a run;
    with ``--resume latest``, the newest of these with checkpoints."""
    save_every: int = 0
    """Checkpoint every N steps (0: by wall time only, ``save_every_minutes``). A run also
    checkpoints after its warm-up and at the end; ``--resume latest`` continues from the newest."""
    save_every_minutes: float = DEFAULT_SAVE_EVERY_MINUTES
    """Checkpoint at the end of the first step this many minutes after the last checkpoint, so a
    crash or a kill loses minutes, not the run (0: off)."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk (oldest deleted first)."""
    overwrite: bool = False
    """Replace an earlier run's outputs in ``output_dir`` (otherwise starting there is an error)."""
    resume: Optional[str] = None
    """Resume from a checkpoint directory, or ``latest`` in ``output_dir``."""
    seed: int = 0
    """Seeds model init, data order, sampling and the warm-up."""
    sync_probe_every: Optional[int] = None
    """Steps between weight-sync probes (None: every step when the sampler holds its own copy of
    the weights, e.g. vLLM; every 10 steps when it runs the policy's own weights, where the
    probe only watches the decode path's numerics)."""
    sync_probe_tolerance: float = 1e-3
    """Largest |sampler logp - trainer logp| on the weight-sync probe before the run stops."""
    tensorboard: bool = True
    """Also log to TensorBoard when it is installed."""
    progress: bool = True
    """Show a progress bar."""
    threads: Optional[int] = None
    """torch intra-op threads, pinned (None: ``OMP_NUM_THREADS`` when set, else the rule of
    ``fastrl.train.run.threads``: on a CPU the cores no other process is using, re-read every half second;
    said at the start of a run). A pinned count is how a seed gives the same run bit for bit."""

    # ------------------------------------------------------------------ resolution
    def resolved(self, *, model_given: bool = False) -> "TrainConfig":
        """A copy with every preset-dependent field filled in and the whole config checked.

        ``model_given``: a model object is passed to the Trainer from Python (not the built-in
        model even though ``model`` is None), so the built-in model's defaults do not apply."""
        if self.algorithm not in ALGORITHM_PRESETS:
            raise InputError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        preset = ALGORITHM_PRESETS[self.algorithm]
        c = dataclasses.replace(self)
        if c.advantage_mode is None:
            c.advantage_mode = preset.advantage
        if c.kl_coef is None:
            c.kl_coef = preset.kl_coef
        if c.dynamic_sampling is None:
            c.dynamic_sampling = preset.dynamic_sampling
        for name in ("turn_gamma", "turn_coef", "outcome_coef"):
            if getattr(c, name) is None:
                setattr(c, name, getattr(preset, name))
        if c.final_turn_coef is None:
            c.final_turn_coef = preset.final_turn_coef if preset.final_turn_coef is not None else c.turn_coef
        builtin_model = c.model is None and not model_given
        builtin_task = c.dataset is None and builtin_model and c.env is None
        default = _default_task()
        if c.env is not None:
            apply_env_defaults(c, builtin_model=builtin_model)
        if c.rewards is None:
            c.rewards = ["exact_match"] if c.env is None else []  # an agent's outcome is its environment's reward
        if c.steps is None:
            c.steps = DEFAULT_RL_STEPS
        if c.max_new_tokens is None:
            c.max_new_tokens = default.max_new_tokens if builtin_task else 256
        if c.eval_prompts is None:
            c.eval_prompts = default.task.num_heldout if builtin_task else DATASET_EVAL_PROMPTS
        for name, value in (("task_digits", default.task.digits), ("task_operations", default.task.operations),
                            ("task_train_size", default.task.num_train), ("task_eval_size", default.task.num_heldout),
                            ("model_hidden_size", default.hidden_size), ("model_layers", default.layers),
                            ("model_heads", default.heads),
                            ("sft_lr", default.sft_lr), ("sft_batch_size", default.sft_batch_size),
                            ("sft_warmup_steps", default.sft_warmup_steps)):
            if getattr(c, name) is None:
                setattr(c, name, value)
        if c.sft_steps is None:
            c.sft_steps = default.sft_max_steps if builtin_model else 0
        if c.sft_check_every is None:
            c.sft_check_every = default.sft_check_every
        if c.sft_target_accuracy is None and builtin_task:
            c.sft_target_accuracy = default.sft_target_accuracy
        if c.lr is None:
            c.lr = default.grpo_lr if builtin_model else 1e-6
        if c.output_dir is None:
            from fastrl.train.rundir import default_output_dir, default_run_name

            c.output_dir = default_output_dir(default_run_name(env=c.env, dataset=c.dataset, model=c.model), resume=c.resume,
                                              overwrite=c.overwrite, numbered=int(os.environ.get("WORLD_SIZE", "1")) == 1)
        c.validate()
        return c

    def policy_loss_config(self) -> PolicyLossConfig:
        """The op-level loss settings: the preset with this run's overrides."""
        preset = ALGORITHM_PRESETS[self.algorithm]
        overrides: dict[str, object] = {}
        for name in ("clip_low", "clip_high", "dual_clip", "loss_agg", "surrogate"):
            value = getattr(self, name)
            if value is not None:
                overrides[name] = value
        overrides["kl_coef"] = 0.0 if self.kl_in_reward else float(self.kl_coef or 0.0)
        overrides["kl_estimator"] = self.kl_estimator
        overrides["entropy_coef"] = self.entropy_coef
        if ROLLOUT_CORRECTIONS[self.rollout_correction].weights:
            overrides["is_cap"] = self.is_cap
            overrides["is_level"] = self.is_level
        agg = overrides.get("loss_agg") or PolicyLossConfig.preset_settings(preset.loss_preset).get("loss_agg")
        if agg == "seq-mean-token-sum-norm":
            # Dr. GRPO's constant: the longest completion, the same for every micro-batch.
            # (an agent run's trajectories: the longest trajectory sample)
            overrides["norm_length"] = float(self.max_trajectory_tokens if self.env is not None else self.max_new_tokens)
        return PolicyLossConfig.preset(preset.loss_preset, **overrides)

    @property
    def uses_critic(self) -> bool:
        return self.advantage_mode == "gae"

    @property
    def uses_turns(self) -> bool:
        """A turn mode (``TURN_MODES``): needs agent trajectories."""
        return self.advantage_mode in TURN_MODES

    @property
    def uses_reference(self) -> bool:
        return bool(self.kl_coef) or self.kl_target is not None

    def validate(self) -> None:
        """Raise :class:`~fastrl.errors.InputError` naming the first bad field (before any work).

        Every field is checked: its type (``Literal`` choices included, also when the config
        is built from Python rather than parsed from the command line), then its range. A
        float option must be finite and, where it enters float32 arithmetic, representable
        in float32 (``kl_coef 1e300`` is refused here, not overflowed inside step 1)."""
        from fastrl.reference.advantages import GROUP_MODES

        _check_field_types(self)

        def positive_int(name: str, allow_zero: bool = False) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if allow_zero else 1):
                raise InputError(f"{name} must be an int >= {0 if allow_zero else 1}, got {v!r}")

        def number(name: str, *, low: float | None = None, high: float | None = None, low_open: bool = False,
                   high_open: bool = False, value: object = None) -> None:
            v = getattr(self, name) if value is None else value
            if v is None:
                return
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) > _FLOAT32_MAX:
                raise InputError(f"{name} must be a finite number (float32 range, |x| <= {_FLOAT32_MAX:.3g}), got {v!r}")
            below = v <= low if low_open else v < low if low is not None else False
            above = v >= high if high_open else v > high if high is not None else False
            if below or above:
                left = "(" if low_open else "["
                right = ")" if high_open or high is None else "]"
                interval = f"{left}{'-inf' if low is None else f'{low:g}'}, {'inf' if high is None else f'{high:g}'}{right}"
                raise InputError(f"{name} must be in {interval}, got {v!r}")

        if self.sft_target_accuracy is not None:
            number("sft_target_accuracy", low=0.0, low_open=True, high=1.0)
        for name in ("group_size", "prompts_per_step", "max_new_tokens", "steps", "ppo_epochs", "mini_batches", "sft_probe_rows", "sft_check_every",
                     "micro_batch_tokens", "eval_prompts", "pass_k", "keep_checkpoints", "task_digits",
                     "task_train_size", "task_eval_size", "model_hidden_size", "model_layers", "model_heads", "sft_batch_size"):
            positive_int(name)
        if self.model_hidden_size is not None and self.model_heads is not None and self.model_hidden_size % self.model_heads:
            raise InputError(f"model_hidden_size ({self.model_hidden_size}) must be a multiple of model_heads ({self.model_heads})")
        for name in ("eval_every", "save_every", "warmup_steps", "max_resample_rounds", "reward_workers", "kl_horizon",
                     "top_k", "seed", "async_steps"):
            positive_int(name, allow_zero=True)
        self._validate_agent(positive_int, number)
        if self.env is not None:
            from fastrl.train.env_task import ENV_TASKS

            if self.env not in ENV_TASKS and ":" not in self.env:
                close = difflib.get_close_matches(self.env, list(ENV_TASKS), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise InputError(f"--env {self.env!r} is neither a built-in environment ({', '.join(ENV_TASKS)}) nor "
                                 f"'module:Class'{hint}")
        if self.seed > _MAX_SEED:
            raise InputError(f"seed must be an int in [0, {_MAX_SEED}] (it seeds Python, NumPy and torch), got {self.seed!r}")
        positive_int("sft_steps", allow_zero=True)
        for name in ("max_generated_tokens", "sync_probe_every", "prompt_token_budget", "max_prompt_length", "threads"):
            if getattr(self, name) is not None:
                positive_int(name)
        if self.max_seconds is not None:
            number("max_seconds", low=0.0, low_open=True)
        number("save_every_minutes", low=0.0)
        if self.advantage_mode not in (*GROUP_MODES, "gae", *TURN_MODES):
            raise InputError(f"advantage_mode must be one of {(*GROUP_MODES, 'gae', *TURN_MODES)}, "
                             f"got {self.advantage_mode!r}")
        if self.uses_turns and self.env is None:
            raise InputError(f"advantage_mode {self.advantage_mode} (algorithm {self.algorithm}) credits the turns of "
                             "agent trajectories: give an environment with --env (e.g. --env frozenlake)")
        number("turn_gamma", low=0.0, high=1.0)
        for name in ("step_coef", "turn_coef", "outcome_coef", "final_turn_coef"):
            number(name)
        if self.advantage_mode != "gae" and self.group_size < 2:
            raise InputError(f"group_size must be >= 2 for group advantages ({self.advantage_mode}), got {self.group_size}")
        if not self.task_operations or set(self.task_operations) - set("+-*"):
            raise InputError(f"task_operations must be characters among '+-*', got {self.task_operations!r}")
        for name in ("lr", "critic_lr", "sft_lr", "temperature", "reward_timeout", "sampler_timeout", "is_cap",
                     "sync_probe_tolerance"):
            number(name, low=0.0, low_open=True)
        number("top_p", low=0.0, low_open=True, high=1.0)
        number("min_lr_ratio", low=0.0, high=1.0)
        number("gamma", low=0.0, high=1.0)
        number("lam", low=0.0, high=1.0)
        number("eval_fraction", low=0.0, low_open=True, high=1.0, high_open=True)
        for name in ("grad_clip", "weight_decay", "kl_coef", "clip_low", "clip_high"):
            number(name, low=0.0)
        number("entropy_coef")
        number("value_clip", low=0.0, low_open=True)
        number("dual_clip", low=1.0, low_open=True)
        if self.kl_target is not None:
            number("kl_target", low=0.0, low_open=True)
        if len(self.adam_betas) != 2:
            raise InputError(f"adam_betas must be two numbers in [0, 1), got {self.adam_betas}")
        for beta in self.adam_betas:
            number("adam_betas", low=0.0, high=1.0, high_open=True, value=beta)
        if self.kl_target is not None and not self.kl_coef:
            raise InputError("kl_target (adaptive KL) needs a starting kl_coef > 0")
        if self.reward_weights is not None:
            if len(self.reward_weights) != len(self.rewards):
                raise InputError(
                    f"reward_weights has {len(self.reward_weights)} entries for {len(self.rewards)} reward functions {self.rewards}"
                )
            for weight in self.reward_weights:
                number("reward_weights", value=weight)
        if not self.rewards and self.env is None:
            raise InputError("rewards must name at least one reward function")
        for name in ("output_dir", "prompt_column", "dataset_split"):
            if not getattr(self, name):
                raise InputError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        for name, kind in (("model", "directory"), ("tokenizer", "directory"), ("critic_init", "directory"),
                           ("dataset", "file or directory"), ("eval_dataset", "file or directory")):
            _check_local_source(name, getattr(self, name), kind)
        if self.resume is not None and not self.resume:
            raise InputError("resume must be 'latest' or a checkpoint directory, got ''")
        if self.device != "auto":
            try:
                import torch

                torch.device(self.device)
            except (RuntimeError, ValueError):
                raise InputError(f"device must be auto, cpu or cuda[:N], got {self.device!r}") from None
        if self.rollout_correction == "bypass" and self.ppo_epochs * self.mini_batches != 1:
            raise InputError(
                "rollout_correction=bypass uses the sampler's log-probs as old log-probs, which is only right with exactly "
                f"one optimizer step per rollout batch; got ppo_epochs={self.ppo_epochs}, mini_batches={self.mini_batches}"
            )
        if self.async_steps:
            self._check_async()
        self._check_rollout()
        self._check_sampler_decode()
        if self.sampler == "vllm-server" and not self.sampler_url:
            raise InputError("sampler=vllm-server needs the server's address: --sampler vllm-server http://HOST:PORT")
        if self.sampler_url is not None and self.sampler != "vllm-server":
            raise InputError(f"sampler_url is only used with sampler=vllm-server, got sampler={self.sampler!r}")
        if self.critic_init is not None and self.advantage_mode != "gae":
            raise InputError(f"critic_init is only used with a critic (algorithm ppo / advantage_mode gae), got {self.advantage_mode}")
        # Build the loss config now so a bad loss option fails before any work.
        try:
            self.policy_loss_config()
        except InputError:
            raise
        except (ValueError, TypeError) as error:
            raise InputError(f"loss options (clip_low, clip_high, dual_clip, loss_agg, surrogate, kl_*, entropy_coef): {error}") from None

    def _validate_agent(self, positive_int, number) -> None:
        """The ``--env`` options: only with an environment, within range, and what an agent run cannot do."""
        if self.env is None:
            given = [name for name in (*AGENT_FIELDS, "env_call_format", "sft_answer_weight") if getattr(self, name) is not None]
            if self.env_reward_weight != 1.0:
                given.append("env_reward_weight")
            if given:
                raise InputError(f"{given[0]} is an agent option: it needs --env (a built-in environment or module:Class)")
            return
        if not self.env:
            raise InputError("env must name a built-in environment or module:Class, got ''")
        positive_int("env_workers")
        if self.sft_answer_weight is not None:
            number("sft_answer_weight", low=0.0, low_open=True)
        positive_int("env_max_repeated_calls", allow_zero=True)
        if self.env_max_repeated_calls == 1:
            raise InputError("env_max_repeated_calls must be 0 (no limit) or >= 2 (a first call is never a repeat), got 1")
        for name in ("env_step_timeout", "env_trajectory_timeout"):
            number(name, low=0.0, low_open=True)
        number("env_reward_weight")
        if self.env_reward_weight == 0 and not self.rewards:
            raise InputError("env_reward_weight 0 leaves an agent run without a reward: give --rewards too")
        self.agent_config()  # AgentConfig's own checks name the field
        if self.dynamic_sampling:
            raise InputError("dynamic_sampling (DAPO's refill of all-equal groups) is not supported with --env yet; "
                             "set --dynamic_sampling false")
        if self.prompt_token_budget is not None:
            raise InputError("prompt_token_budget batches prompts by their length; with --env use prompts_per_step")

    def agent_config(self) -> AgentConfig:
        """The run's ``AgentConfig``: its ``AGENT_FIELDS`` (a resolved config has them all)."""
        missing = [name for name in AGENT_FIELDS if getattr(self, name) is None]
        if missing:
            raise InputError(f"{missing[0]} is not set: resolve the config first (TrainConfig.resolved())")
        return AgentConfig(**{name: getattr(self, name) for name in AGENT_FIELDS})

    def tree_schedule(self) -> "BranchSchedule":
        """``rollout=tree``'s ``BranchSchedule`` (``tree_branches`` / ``tree_depths`` or the default)."""
        from fastrl.rollout.branch import BranchSchedule

        L = self.max_new_tokens if self.max_new_tokens is not None else 2
        branches = self.tree_branches if self.tree_branches is not None else BranchSchedule.default(
            group_size=self.group_size, max_new_tokens=L).branches
        depths = self.tree_depths if self.tree_depths is not None else [L * i // len(branches) for i in range(len(branches))]
        return BranchSchedule(branches=tuple(branches), depths=tuple(depths))

    def turn_schedule(self) -> "TurnSchedule":
        """``rollout=tree`` with ``--env``: the ``TurnSchedule`` (``tree_branches`` /
        ``tree_turns`` or the default, ``fastrl.agents.branching``)."""
        from fastrl.agents.branching import TurnSchedule

        turns = self.max_turns if self.max_turns is not None else 1
        if self.tree_branches is None and self.tree_turns is None:
            return TurnSchedule.default(group_size=self.group_size, max_turns=turns)
        branches = self.tree_branches if self.tree_branches is not None else [self.group_size]
        at = self.tree_turns if self.tree_turns is not None else list(range(len(branches)))
        return TurnSchedule(branches=tuple(branches), turns=tuple(at))

    def _check_agent_tree(self) -> None:
        """``rollout=tree`` with ``--env``: a turn schedule that fits, and the advantage modes
        whose credit does not clash with the tree's step groups."""
        if self.tree_depths is not None:
            raise InputError("tree_depths are token depths of single-turn tree rollouts; with --env the tree branches at "
                             "policy turns: give --tree_turns (e.g. --tree_turns \"[0, 1]\" --tree_branches \"[2, 4]\" for group_size 8)")
        if self.uses_turns:
            raise InputError(f"advantage_mode {self.advantage_mode} (algorithm {self.algorithm}) forms its own per-turn "
                             "step groups, which would credit the turns twice beside rollout=tree's branch points (siblings "
                             "compared below each, step_coef): use a group mode (grpo, dr_grpo, ...) or gae with --rollout "
                             "tree, or --rollout independent with this mode")
        schedule = self.turn_schedule()
        if self.max_turns is not None:
            schedule.check(group_size=self.group_size, max_turns=self.max_turns)

    def _check_rollout(self) -> None:
        """``rollout=tree``: a schedule that fits the run, and what a tree rollout cannot do yet."""
        if self.rollout != "tree":
            given = [name for name in ("tree_branches", "tree_depths", "tree_turns") if getattr(self, name) is not None]
            if given:
                raise InputError(f"{given[0]} shapes a tree rollout: it needs --rollout tree")
            return
        if self.env is None and self.tree_turns is not None:
            raise InputError("tree_turns are the policy turns of agent trajectories: they need --env (single-turn trees "
                             "branch at token depths, --tree_depths)")
        for what, bad in (("async_steps", bool(self.async_steps)), ("dynamic_sampling", bool(self.dynamic_sampling))):
            if bad:
                raise InputError(f"rollout=tree is not supported with {what} yet: use --rollout independent")
        if self.env is not None:
            return self._check_agent_tree()
        schedule = self.tree_schedule()
        if self.max_new_tokens is not None:
            schedule.check(group_size=self.group_size, max_new_tokens=self.max_new_tokens)

    def _check_async(self) -> None:
        """What ``async_steps >= 1`` needs (each refusal names the option and what works)."""
        n = self.async_steps
        if self.env is not None:
            raise InputError(f"async_steps={n} is not supported with --env yet (agent rollouts are collected in the "
                             "trainer's process, with its environment workers): set --async_steps 0")
        if not ROLLOUT_CORRECTIONS[self.rollout_correction].stale_ok:
            stale = sorted(k for k, v in ROLLOUT_CORRECTIONS.items() if v.stale_ok)
            raise InputError(
                f"async_steps={n} trains on rollouts of a policy up to {n} updates old: rollout_correction must see the "
                f"sampler's log-probs, one of {stale} (decoupled: AReaL's decoupled PPO), got {self.rollout_correction!r}"
            )
        if self.sampler != "hf":
            raise InputError(f"async_steps={n} runs the hf sampler in a process of its own: sampler must be hf, got "
                             f"{self.sampler!r} (no asynchronous vLLM sampler yet: the in-process engine shares the "
                             "trainer's process, and a vllm-server is not yet driven ahead of the trainer)")
        if self.device.startswith("cuda"):
            raise InputError(f"async_steps={n}: the sampler process runs on the CPU (forked from the trainer); "
                             f"device must be cpu or auto without a GPU, got {self.device!r}")

    def _check_sampler_decode(self) -> None:
        """``sampler_decode`` is the hf sampler's; ``cuda_graph`` needs a CUDA device."""
        mode = self.sampler_decode
        if mode != "eager" and self.sampler != "hf":
            raise InputError(f"sampler_decode={mode} is the hf sampler's decode step: it needs sampler=hf, got "
                             f"sampler={self.sampler!r} (drop sampler_decode)")
        if mode == "cuda_graph":
            import torch

            on_cuda = self.device.startswith("cuda") or (self.device == "auto" and torch.cuda.is_available())
            if not on_cuda:
                raise InputError(f"sampler_decode=cuda_graph needs a CUDA device, this run's device is {self.device!r} "
                                 "without one: use sampler_decode eager or static")

    @property
    def builtin_model(self) -> bool:
        return self.model is None

    @property
    def on_policy(self) -> bool:
        """One optimizer step per rollout batch: the old policy is the current one."""
        return self.ppo_epochs * self.mini_batches == 1


def _check_field_types(config: "TrainConfig") -> None:
    """Each field's value has its annotated type (``Literal`` choices, ``Optional``, lists)."""
    hints = typing.get_type_hints(type(config))
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        problem = _type_problem(value, hints[item.name])
        if problem is not None:
            raise InputError(f"{item.name} must be {problem}, got {value!r}")


def _type_problem(value: object, annotation: object) -> str | None:
    """``None`` when ``value`` fits ``annotation``, else what would be accepted."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        options = [argument for argument in arguments if argument is not type(None)]
        if value is None:
            return None
        return _type_problem(value, options[0]) if len(options) == 1 else None
    if origin is Literal:
        return None if value in arguments else f"one of {list(arguments)}"
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return "a list"
        for entry in value:
            if _type_problem(entry, arguments[0]) is not None:
                return f"a list of {getattr(arguments[0], '__name__', arguments[0])}"
        return None
    if annotation is bool:
        return None if isinstance(value, bool) else "true or false"
    if annotation is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an int"
    if annotation is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if annotation is str:
        return None if isinstance(value, str) else "a string"
    return None


def _looks_like_a_path(source: str) -> bool:
    """A source spelled as a path (``/x``, ``./x``, ``~/x``, ``a/b/c``), not a hub id (``name`` or ``org/name``)."""
    return source.startswith((".", "/", "~")) or source.count("/") > 1 or "\\" in source


def _check_local_source(name: str, source: str | None, kind: str) -> None:
    """A source given as a path must exist: say so, rather than let it be read as a hub id."""
    if source is None:
        return
    if not source:
        raise InputError(f"{name} must be a local {kind} or a hub id, got ''")
    path = os.path.expanduser(source)
    if _looks_like_a_path(source) and not os.path.exists(path):
        raise InputError(
            f"{name} {source!r}: the {kind} does not exist (a path is read locally, never downloaded; a hub id is "
            "written 'org/name')"
        )


def apply_env_defaults(cfg: TrainConfig, *, builtin_model: bool) -> None:
    """Fill ``cfg``'s ``None`` fields (in place) for its ``env``: the built-in environment's
    ``EnvTask``, or ``AgentConfig``'s limits for a user's environment. ``builtin_model``: the
    run builds the tiny model (the warm-up and the model sizes apply). The defaults are data in
    ``fastrl/train/env_task.py``; this is the rule that applies them."""
    from fastrl.train.env_task import ENV_TASKS, USER_ENV_ROWS

    task = ENV_TASKS.get(cfg.env)
    limits = dataclasses.asdict(AgentConfig(**(task.agent if task is not None else {})))
    for name, value in limits.items():
        if getattr(cfg, name) is None:
            setattr(cfg, name, value)
    if cfg.max_new_tokens is None:
        cfg.max_new_tokens = cfg.max_turn_tokens  # the weight-sync probe's length; the loss's norm_length
    if task is None:
        train, heldout = USER_ENV_ROWS
        fills = {"task_train_size": train, "task_eval_size": heldout, "sft_answer_weight": 1.0}
        if cfg.sft_steps is None:
            cfg.sft_steps = 0
    else:
        fills = {"task_train_size": task.num_train, "task_eval_size": task.num_heldout, "sft_lr": task.sft_lr, "sft_batch_size": task.sft_batch_size, "sft_warmup_steps": task.sft_warmup_steps,
                 "sft_check_every": task.sft_check_every, "sft_answer_weight": task.sft_answer_weight}
        if builtin_model:
            fills.update(model_hidden_size=task.hidden_size, model_layers=task.layers, model_heads=task.heads, lr=task.lr,
                         sft_steps=task.sft_max_steps, sft_target_accuracy=task.sft_target_accuracy)
    for name, value in fills.items():
        if getattr(cfg, name) is None:
            setattr(cfg, name, value)
    if cfg.eval_prompts is None:
        cfg.eval_prompts = cfg.task_eval_size  # every held-out row
    if cfg.env_call_format is None:
        cfg.env_call_format = "compact" if builtin_model else "hermes"
