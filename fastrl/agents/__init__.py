"""Agent RL: environments, tools, the token-native multi-turn driver and the environment runtime.

Modules (imports point down the list):

- ``metric_names``: the names of the metrics agent rollouts log (``agent/...``, ``env/...``,
  the tree figures), for the code that writes them and the code that reads them.
- ``env``: the ``Environment`` protocol (``reset(row, seed) -> messages``, ``step(action) ->
  StepResult(observation, reward, done, info)``, ``close()``), validation (``InputError``),
  the default state key (a hash of the observation's tokens).
- ``tools``: tools as typed functions (schemas from signature + docstring), the ``hermes``
  (``<tool_call>{json}</tool_call>``) and ``compact`` (``name(args)``, for the built-in
  character tokenizer) call formats, argument checks, ``FAILURE_KINDS``, the repeated-call detector.
- ``tool_env``: ``ToolEnv`` (a turn is tool calls or the final answer) and ``TRLEnvironment``
  (a TRL ``environment_factory`` class, unchanged).
- ``envs``: ``calculator``, ``sql``, ``frozenlake`` (seeded rows, oracles),
  ``resolve_environment(name | "module:Class")``, ``synthetic_transcripts`` (SFT warm-up data).
- ``render``: ``ChatRenderer``: prompts, environment turns as token deltas against a fixed
  base conversation (with the template's turn separator), the template check;
  ``demonstration_sample`` (a warm-up example in RL's exact layout).
- ``trajectory``: ``Trajectory`` / ``TrajectorySample`` / ``Segment``; ``format_trajectory``.
- ``runtime``: ``EnvRuntime`` (environments in ``fastrl.workers`` processes: concurrent steps,
  per-call and per-trajectory limits, kill + replace + replay), ``InProcessRuntime``,
  ``probe_environment``.
- ``driver``: ``AgentConfig``, ``TokenSampler`` (+ ``GroupSamplerTokens`` over any
  ``GroupSampler``), ``run_episodes``, ``agent_metrics``.
- ``batch``: ``AgentBatch``: trajectories -> the step's ``[R, T]`` tensors (loss mask,
  sampler log-probs, per-turn rewards, policy segments) and a ``RolloutBatch`` view;
  ``collate_samples`` (demonstrations -> ``fastrl.train.sft.sft_loss`` inputs).

How a trainer uses it (one step)::

    factory = resolve_environment("calculator")                     # InputError on a bad spec
    runtime = EnvRuntime(factory, num_workers=4, step_timeout_s=10, trajectory_timeout_s=60)
    probe_environment(runtime, train_rows[0])                        # before step 1
    renderer = ChatRenderer(tokenizer, tools=schemas_or_None)        # hermes: tools=tool_schemas(env.tools)
    sampler = GroupSamplerTokens(group_sampler, sampling)            # re-prefills the history each turn
    trajectories, metrics = run_episodes(rows, group_size=G, runtime=runtime, renderer=renderer,
                                         sampler=sampler, config=AgentConfig(...), seeds=row_seeds)
    batch = AgentBatch.from_trajectories(trajectories, group_size=G, pad_token_id=pad)
    # loss mask = batch.loss_mask[:, 1:]; outcome rewards = batch.rewards (+ reward functions on
    # the transcripts); leave batch.excluded rows out; batch.turn_rewards for per-turn credit.
"""
