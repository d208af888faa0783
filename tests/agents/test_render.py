"""Token deltas against a base conversation, the turn separator, the template check, the
split into samples where a template is not prefix-preserving, limits and stop reasons."""

import pytest

from fastrl.agents import metric_names as names
from fastrl.agents.driver import AgentConfig, run_episodes
from fastrl.agents.envs import synthetic_transcripts
from fastrl.agents.envs.calculator import CalculatorEnv, calculator_rows
from fastrl.agents.envs.frozenlake import FrozenLakeEnv
from fastrl.agents.render import ChatRenderer, demonstration_sample
from fastrl.agents.runtime import InProcessRuntime
from fastrl.agents.tools import tool_schemas
from fastrl.train.task import char_tokenizer
from scripted import ScriptedSampler

# ChatML as Qwen/Hermes templates write it: "<|im_start|>role\ncontent<eos>\n"; tools in a system turn.
CHATML = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<eos>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>{% else %}{{ m['content'] }}{% endif %}"
    "<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Like templates that drop earlier turns' reasoning: only the last assistant message is shown in full.
FORGETFUL = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# Rewrites earlier assistant turns but renders the base conversation as a prefix: a delta exists, the check fails.
REWRITING = FORGETFUL.replace("{% if m['role'] == 'assistant' and not loop.last %}...", "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'] | replace('calc', 'CALC') }}")


def _tokenizer(template=None):
    tokenizer = char_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def _calculator_run(tokenizer, renderer, *, call_format, config=None, script=None, rows=2):
    train, _ = calculator_rows(num_train=rows, num_heldout=0, seed=0)
    oracle = {i: [t["content"] for t in transcript if t["role"] == "assistant"]
              for i, (_, transcript) in enumerate(synthetic_transcripts("calculator", train, call_format=call_format))}
    sampler = ScriptedSampler(tokenizer, script or (lambda trajectory, turn: oracle[trajectory][turn]))
    with InProcessRuntime(lambda: CalculatorEnv(call_format=call_format)) as runtime:
        return run_episodes(train, group_size=1, runtime=runtime, renderer=renderer, sampler=sampler,
                            config=config or AgentConfig(max_turns=4, max_turn_tokens=128, max_trajectory_tokens=1024), seeds=list(range(rows))), train


def test_builtin_template_deltas_match_the_template_exactly():
    tokenizer = _tokenizer()
    renderer = ChatRenderer(tokenizer)
    assert renderer.separator_ids == []  # the assistant turn ends with <eos>, nothing after it
    (trajectories, metrics), rows = _calculator_run(tokenizer, renderer, call_format="compact")
    assert metrics[names.TOKENIZATION_MISMATCH_RATE] == 0.0 and metrics[names.SAMPLES_PER_TRAJECTORY] == 1.0
    for t, row in zip(trajectories, rows):
        assert t.stop_reason == "answer" and t.outcome_reward == 1.0 and t.turns == 2 and t.tool_calls == 1
        (sample,) = t.samples
        sample.check()
        rendered = tokenizer.apply_chat_template(t.messages, tokenize=False)
        assert sample.token_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert [(s.role, s.turn) for s in sample.segments] == [("prompt", -1), ("policy", 0), ("env", 0), ("policy", 1)]
        env = sample.segments[2]
        assert tokenizer.decode(sample.token_ids[env.start:env.end]) == f"<|tool|>{row['answer']}<|assistant|>"


def test_chatml_separator_is_kept_and_tools_are_rendered():
    tokenizer = _tokenizer(CHATML)
    schemas = tool_schemas(CalculatorEnv.tools)
    renderer = ChatRenderer(tokenizer, tools=schemas)
    assert renderer.separator_ids == tokenizer("\n", add_special_tokens=False)["input_ids"]
    (trajectories, metrics), _ = _calculator_run(tokenizer, renderer, call_format="hermes")
    assert metrics[names.TOKENIZATION_MISMATCH_RATE] == 0.0
    for t in trajectories:
        assert t.outcome_reward == 1.0
        rendered = tokenizer.apply_chat_template(t.messages, tools=schemas, add_generation_prompt=False, tokenize=False)
        # the whole trajectory is the template's rendering, minus the final separator the policy never samples
        assert tokenizer.decode(t.samples[0].token_ids) + "\n" == rendered
        assert '"name": "calc"' in tokenizer.decode(t.samples[0].token_ids[: t.samples[0].prompt_length])


@pytest.mark.parametrize("template, split, samples, shown", [
    (REWRITING, True, 2, "CALC("),
    (REWRITING, False, 1, None),  # counted, not split
    (FORGETFUL, False, 2, "..."),  # no delta exists: always a new sample
])
def test_a_template_that_rewrites_history_is_counted_and_split(template, split, samples, shown):
    tokenizer = _tokenizer(template)
    renderer = ChatRenderer(tokenizer)
    config = AgentConfig(max_turns=4, max_turn_tokens=64, split_on_mismatch=split)
    (trajectories, metrics), _ = _calculator_run(tokenizer, renderer, call_format="compact", config=config)
    assert metrics[names.TOKENIZATION_MISMATCH_RATE] == 1.0
    for t in trajectories:
        assert t.outcome_reward == 1.0
        assert len(t.samples) == samples
        for sample in t.samples:
            sample.check()
            assert sum(sample.loss_mask) > 0
        if samples == 2:
            second = t.samples[1]
            context = second.token_ids[: second.prompt_length]
            assert context == renderer.render(t.messages[:3], add_generation_prompt=True)
            assert shown in tokenizer.decode(context)  # the template's own view of turn 0
            # each policy turn is trained exactly once, on its exact sampled ids
            assert [s.turn for sample in t.samples for s in sample.segments if s.role == "policy"] == [0, 1]


def test_demonstrations_have_the_layout_rl_produces():
    tokenizer = _tokenizer()
    renderer = ChatRenderer(tokenizer)
    (trajectories, _), rows = _calculator_run(tokenizer, renderer, call_format="compact")
    for t, (prompt, transcript) in zip(trajectories, synthetic_transcripts("calculator", rows)):
        demo = demonstration_sample(renderer, prompt, transcript)
        demo.check()
        assert demo.token_ids == t.samples[0].token_ids and demo.loss_mask == t.samples[0].loss_mask


def test_observation_truncation_sides():
    tokenizer = _tokenizer()
    renderer = ChatRenderer(tokenizer)
    script = lambda trajectory, turn: ["calc(123456789*1000)", "0"][turn]
    for side, kept in (("end", "1234"), ("start", "9000")):
        config = AgentConfig(max_turns=3, max_turn_tokens=64, max_observation_tokens=4, truncate_side=side)
        (trajectories, _), _ = _calculator_run(tokenizer, renderer, call_format="compact", config=config, script=script, rows=1)
        assert trajectories[0].messages[2]["content"] == kept


def test_limits_and_stop_reasons():
    tokenizer = _tokenizer()
    renderer = ChatRenderer(tokenizer)
    loop = lambda trajectory, turn: "calc(1+1)" if turn % 2 else "calc(2+2)"
    (t,), _ = _calculator_run(tokenizer, renderer, call_format="compact", script=loop, rows=1,
                              config=AgentConfig(max_turns=3, max_turn_tokens=64))[0]
    assert t.stop_reason == "max_turns" and t.turns == 3 and t.outcome_reward == 0.0
    assert len(t.turn_rewards) == len(t.state_keys) == 3
    # default state keys: a hash of the observation's tokens ("4", "2", "4")
    assert t.state_keys[0] == t.state_keys[2] != t.state_keys[1] and t.state_keys[0].startswith("obs:")
    (t,), _ = _calculator_run(tokenizer, renderer, call_format="compact", script=loop, rows=1,
                              config=AgentConfig(max_turns=9, max_turn_tokens=64, max_trajectory_tokens=60))[0]
    assert t.stop_reason == "max_trajectory_tokens" and t.num_tokens <= 60
    (t,), _ = _calculator_run(tokenizer, renderer, call_format="compact", script=lambda *_: "calc(1+1)", rows=1,
                              config=AgentConfig(max_turns=9, max_turn_tokens=64))[0]
    assert t.stop_reason == "repeated_call" and t.turns == 3
    (t,), _ = _calculator_run(tokenizer, renderer, call_format="compact", script=lambda *_: "x" * 20, rows=1,
                              config=AgentConfig(max_turns=9, max_turn_tokens=8))[0]
    assert t.stop_reason == "turn_length" and t.count("policy") == 8


def test_frozenlake_state_keys_repeat_for_repeated_states():
    tokenizer = _tokenizer()
    row = {"prompt": "p", "grid": ["..G", "...", "..."], "start": [2, 0], "answer": "4"}
    sampler = ScriptedSampler(tokenizer, lambda trajectory, turn: ["down", "left", "up", "up", "right", "right"][turn])
    with InProcessRuntime(FrozenLakeEnv) as runtime:
        (t,), _ = run_episodes([row], group_size=1, runtime=runtime, renderer=ChatRenderer(tokenizer), sampler=sampler,
                               config=AgentConfig(max_turns=8), seeds=[0])
    assert t.stop_reason == "goal" and t.outcome_reward == 1.0 and t.turn_rewards == [0, 0, 0, 0, 0, 1.0]
    assert t.state_keys[0] == t.state_keys[1] and len(set(t.state_keys)) == 5
