"""The lean GRPO/PPO trainer: ``Trainer(TrainConfig(...)).train()`` or ``fastrl train``.

Rooms (each a small module): ``trainer`` (the loop) over an ``experience.Experience``, its
parts built by ``assemble``'s stages; the stages behind ``contracts`` (``Collector``,
``Evaluator``): ``collect`` / ``tree_collect`` / ``async_collect`` (chosen in ``collectors``),
``score``, ``advantages``, ``weights`` (sync and probe), ``evaluate``; ``layout`` (padded rows
or packed groups), ``ranks`` (one process or many);
what a run is built from: ``policy``, ``prompts`` (over ``data``: loading, batching),
``samplers`` (the sampler registry), ``reference_policy``, ``critic`` (PPO value model),
``optimizers``, ``warmup`` (the supervised warm-up stage, over ``sft``), ``rewards`` (TRL-signature
reward functions in a process pool with time limits); ``agent/`` is the wing of ``--env``
runs (the same contracts); ``run/`` is the run's housekeeping around the loop (signals,
threads, hub checks, the heap, fault messages, checkpoints and their manifests, progress bars,
metrics loggers), ``rundir`` the output folder's lock and default folders; ``task`` holds the
built-in task, tokenizer and tiny model of the embedded default. ARCHITECTURE.md maps them.
"""

from fastrl.train.config import ALGORITHM_PRESETS, ALGORITHMS, TrainConfig

__all__ = ["ALGORITHMS", "ALGORITHM_PRESETS", "TrainConfig", "Trainer", "TrainResult"]


def __getattr__(name: str):
    # the trainer pulls in transformers; import it only when asked for
    if name in ("Trainer", "TrainResult", "TrainingDivergedError", "WeightSyncError"):
        from fastrl.train import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
