"""A scripted policy for driver and runtime tests: the TokenSampler seam, writing given turns."""

from fastrl.agents.driver import TURN_SEED_STRIDE, Continuation


class ScriptedSampler:
    """Turn ``k`` of the trajectory whose sampling seed is ``s`` writes ``script(trajectory, k)``,
    where ``trajectory = s // TURN_SEED_STRIDE`` (``env_seed * G + index``) and ``k = s % TURN_SEED_STRIDE``;
    then the stop token. Log-probs are -1.0 per token (there is no model)."""

    def __init__(self, tokenizer, script, *, stop_token_id=None):
        self.tokenizer = tokenizer
        self.script = script
        self.stop = tokenizer.eos_token_id if stop_token_id is None else stop_token_id
        self.calls = []

    def continue_sequences(self, sequences, *, max_new_tokens, seeds):
        self.calls.append([list(s) for s in sequences])
        out = []
        for n, seed in zip(max_new_tokens, seeds):
            text = self.script(seed // TURN_SEED_STRIDE, seed % TURN_SEED_STRIDE)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.stop]
            stopped = len(ids) <= n
            ids = ids[:n]
            out.append(Continuation(ids, [-1.0] * len(ids), stopped))
        return out
