"""The lean GRPO/PPO trainer: ``Trainer(TrainConfig(...)).train()`` or ``fastrl train``.

Rooms (each a small module): ``trainer`` (the loop) over an ``experience.Experience``;
``layout`` (padded rows or packed groups), ``ranks`` (one process or many), ``samplers``
(the sampler registry), ``policy``, ``prompts``, ``optimizers``, ``collect`` (rollout and dynamic sampling),
``advantages``, ``weights`` (sync and probe), ``evaluate``, ``checkpoint``, ``metrics``,
``seeds``, ``score``; ``data`` (prompts, batching), ``rewards`` (TRL-signature reward
functions in a process pool with time limits), ``sft`` (the optional supervised warm-up),
``critic`` (PPO value model), ``schedule``; ``task`` holds the built-in task, tokenizer and
tiny model of the embedded default. ARCHITECTURE.md maps them.
"""

from fastrl.train.config import ALGORITHM_PRESETS, ALGORITHMS, TrainConfig

__all__ = ["ALGORITHMS", "ALGORITHM_PRESETS", "TrainConfig", "Trainer", "TrainResult"]


def __getattr__(name: str):
    # the trainer pulls in transformers; import it only when asked for
    if name in ("Trainer", "TrainResult", "TrainingDivergedError", "WeightSyncError"):
        from fastrl.train import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
