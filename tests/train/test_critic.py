"""The PPO critic: alignment with the log-prob layout, persistence, and that it can fit a value function."""

import torch

from fastrl.ops import value_loss
from fastrl.train.critic import ValueModel, explained_variance
from fastrl.train.task import char_tokenizer, tiny_model


def test_values_align_with_the_states_before_each_scored_token():
    torch.manual_seed(0)
    critic = ValueModel(tiny_model(char_tokenizer(), hidden_size=32, layers=1))
    ids = torch.randint(7, 100, (2, 9))
    full = critic.values(ids, torch.ones_like(ids), 8)  # states before tokens 1..8
    last3 = critic.values(ids, torch.ones_like(ids), 3)  # before tokens 6..8
    torch.testing.assert_close(last3, full[:, -3:])
    # the value before token t depends only on tokens < t
    changed = ids.clone()
    changed[:, 8] = 7
    torch.testing.assert_close(critic.values(changed, torch.ones_like(ids), 8), full)


def test_save_and_load_round_trip(tmp_path):
    critic = ValueModel(tiny_model(char_tokenizer(), hidden_size=32, layers=1))
    critic.save(tmp_path / "c")
    loaded = ValueModel.load(tmp_path / "c", device=torch.device("cpu"))
    ids = torch.randint(7, 100, (3, 6))
    torch.testing.assert_close(loaded.values(ids, torch.ones_like(ids), 5), critic.values(ids, torch.ones_like(ids), 5))


def test_the_critic_fits_a_known_value_function():
    """Returns-to-go of a toy task: the reward is 1 at the end of a sequence iff its first
    completion token is a digit. The value of every state after that token is that reward (gamma 1);
    before it, the probability of a digit (10/20 here). The critic must learn it from (state, return)
    pairs with the clipped value loss."""
    torch.manual_seed(0)
    tok = char_tokenizer()
    digits = tok.convert_tokens_to_ids(list("0123456789"))
    letters = tok.convert_tokens_to_ids(list("abcdefghij"))
    critic = ValueModel(tiny_model(tok, hidden_size=32, layers=1, seed=1))
    opt = torch.optim.AdamW(critic.parameters(), lr=3e-3)
    prompt = tok.convert_tokens_to_ids(list("q:"))

    def batch(n):
        first = torch.tensor([digits[i % 10] if i % 2 == 0 else letters[i % 10] for i in torch.randint(0, 1000, (n,)).tolist()])
        rest = torch.randint(min(letters), max(letters) + 1, (n, 3))
        ids = torch.cat([torch.tensor(prompt).expand(n, -1), first[:, None], rest], 1)
        reward = torch.isin(first, torch.tensor(digits)).float()
        returns = reward[:, None].expand(n, 4).clone()  # 4 completion tokens, gamma = 1, reward at the end
        return ids, returns

    for _ in range(150):
        ids, returns = batch(32)
        values = critic.values(ids, torch.ones_like(ids), 4)
        loss, _ = value_loss(values, values.detach(), returns, torch.ones_like(returns), clip=None)
        opt.zero_grad()
        loss.backward()
        opt.step()
    ids, returns = batch(256)
    with torch.no_grad():
        values = critic.values(ids, torch.ones_like(ids), 4)
    # states after the decisive token: values match the outcome
    ev = explained_variance(values[:, 1:], returns[:, 1:], torch.ones_like(returns[:, 1:]))
    assert ev > 0.95, ev
    # the state before it: the prior probability of a digit
    assert abs(float(values[:, 0].mean()) - 0.5) < 0.1


def test_explained_variance_definition():
    r = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    assert float(explained_variance(r, r, m)) == 1.0
    assert abs(float(explained_variance(torch.full_like(r, 2.0), r, m))) < 1e-6
