"""Reward functions for ``fastrl train --env ... --rewards`` tests (imported by name, as a
user's module would be). Each checks what an agent run promises to pass it (see
``fastrl/train/agent/score.py``) and raises otherwise, so a broken promise shows up as
``reward/<name>/raised`` in the metrics."""


def turns_tenth(prompts, completions, completion_ids, answer, env_reward, turn_rewards, stop_reason, log_metric, **kwargs):
    """A tenth of a point per policy turn (the assistant messages of the completion)."""
    out = []
    for prompt, completion, ids, reference, outcome, per_turn, reason in zip(
            prompts, completions, completion_ids, answer, env_reward, turn_rewards, stop_reason):
        assert prompt and all(m["role"] != "assistant" for m in prompt), prompt  # the first observation only
        assert completion[0]["role"] == "assistant", completion  # the completion starts with the first policy turn
        assert isinstance(reference, str) and isinstance(outcome, float) and isinstance(reason, str) and reason
        assert isinstance(per_turn, list) and isinstance(ids, list) and all(isinstance(t, int) for t in ids)
        out.append(0.1 * sum(m["role"] == "assistant" for m in completion))
    log_metric("policy_tokens", sum(len(ids) for ids in completion_ids) / len(completion_ids))
    return out
