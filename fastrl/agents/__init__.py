"""Agent RL: environments, tools, the token-native multi-turn driver and the environment runtime.

- ``env``: the ``Environment`` protocol (``reset(row, seed)``, ``step(action)``, ``close()``),
  ``StepResult``, validation, the default state key.
- ``tools``: tools as typed functions (schemas from signature + docstring), the ``hermes`` and
  ``compact`` call formats, argument checks, failure kinds, the repeated-call detector.
- ``tool_env``: ``ToolEnv`` (tool calls or a final answer) and ``TRLEnvironment`` (TRL's
  ``environment_factory`` shape, unchanged).
- ``render``: an environment turn as a token delta against a fixed base conversation.
- ``trajectory``: ``Trajectory`` (exact token ids, segments, loss mask, log-probs, rewards).
- ``driver``: the multi-turn loop over a ``TokenSampler``.
- ``runtime``: environments in worker processes, bounded and killable.
- ``envs``: ``calculator``, ``sql``, ``frozenlake``; ``resolve_environment``; synthetic transcripts.
"""
