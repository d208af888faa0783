"""The agent wing of the trainer: what ``fastrl train --env`` runs in place of the single-turn stages.

Each module is the agent counterpart of a single-turn room, behind the same contract
(``fastrl.train.contracts``): ``build`` (the environment side of a run: rows, workers,
renderer, scorer, the warm-up on the oracle's transcripts), ``collect`` (``AgentCollector``:
trajectories played turn by turn), ``tree_collect`` (``AgentTreeCollector``: trajectories
branching at turns), ``evaluate`` (``AgentEvaluator``: greedy held-out episodes), ``score``
(``TrajectoryScorer``: the environment's outcome and the ``--rewards`` functions). What each
built-in environment brings (``ENV_TASKS``) sits beside the single-turn task's defaults, in
``fastrl.train.env_task``, below the config rule that applies it. The environments, renderer
and driver themselves are ``fastrl.agents``.
"""
