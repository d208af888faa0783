"""The lean GRPO/PPO trainer: ``Trainer(TrainConfig(...)).train()`` or ``fastrl train``.

Stages (each a small module, plain tensors in and out): ``data`` (prompts, batching),
``rewards`` (TRL-signature reward functions in a process pool with time limits), ``sft``
(the optional supervised warm-up), ``critic`` (PPO value model), ``trainer`` (the loop),
``checkpoint``, ``metrics``, ``schedule``; ``task`` holds the built-in task, tokenizer and
tiny model of the embedded default.
"""

from fastrl.train.config import ALGORITHM_PRESETS, ALGORITHMS, TrainConfig

__all__ = ["ALGORITHMS", "ALGORITHM_PRESETS", "TrainConfig", "Trainer", "TrainResult"]


def __getattr__(name: str):
    # the trainer pulls in transformers; import it only when asked for
    if name in ("Trainer", "TrainResult", "TrainingDivergedError", "WeightSyncError"):
        from fastrl.train import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
