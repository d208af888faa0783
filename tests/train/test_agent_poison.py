"""Garbage where an agent step must not look: the trainer's update on a real ``--env calculator``
rollout is bitwise the same when every position of the step's ``Experience`` that carries no
loss (prompt and environment tokens, padding) holds NaN, +-inf or 3e38 in its log-prob and
per-turn reward tensors and a wrong token id in its padding -- in each training layout (padded
rows, the packed groups, the prefix tree) and through the loss inputs that read those tensors
(the sampler's log-probs as the old ones, importance weights, the reference KL, a critic).

Two trainers of the same seed run the same step through ``Poisoned``; one of them poisons the
``Experience`` its collector builds. Their losses, gradient norms and updated weights must be
equal. One case also leaves a trajectory out (``failed_trajectories=mask``'s ``excluded``) and
gives it a NaN outcome reward: it must reach neither the loss nor its group's baseline."""

import pytest
import torch

from fastrl.agents import metric_names as names
from fastrl.train import TrainConfig
from fastrl.train.trainer import Trainer

BASE = dict(env="calculator", steps=1, prompts_per_step=2, group_size=2, task_train_size=32, task_eval_size=2,
            model_hidden_size=64, model_layers=1, sft_steps=40, sft_batch_size=32, sft_check_every=1000, env_workers=1,
            reward_workers=0, max_turns=2, eval_every=0, progress=False, tensorboard=False, seed=0, threads=1)
GARBAGE = (float("nan"), float("inf"), -float("inf"), 3e38)


def garbage_like(count: int) -> torch.Tensor:
    return torch.tensor(GARBAGE).repeat(count // len(GARBAGE) + 1)[:count]


class Poisoned:
    """The run's collector, whose ``experience`` comes back with its no-loss positions poisoned
    (``poison``); the rows ``exclude`` are marked excluded (as a failed environment's are with
    ``failed_trajectories=mask``) and, when poisoned, their outcome reward is NaN."""

    def __init__(self, collector, *, poison: bool, exclude: tuple[int, ...] = ()):
        self.collector, self.poison, self.exclude = collector, poison, list(exclude)
        self.poisoned = 0

    def __getattr__(self, name):
        return getattr(self.collector, name)

    def experience(self, rollout, *, device):
        rollout.batch.excluded[self.exclude] = True
        if self.poison:
            rollout.batch.rewards[self.exclude] = float("nan")
        exp = self.collector.experience(rollout, device=device)
        if not self.poison:
            return exp
        masked = exp.loss_mask == 0  # [B, T-1]: prompt, environment and padding positions (and excluded rows)
        for tensor in (exp.sampler_logp, exp.turn_rewards, exp.batch.sampler_logp[:, 1:]):
            tensor[masked] = garbage_like(int(masked.sum())).to(tensor)
        padding = exp.batch.attention_mask == 0
        exp.batch.input_ids[padding] = exp.batch.input_ids.max()  # a real token id, not the pad id
        self.poisoned = int(masked.sum())
        return exp


def one_step(tmp_path, name, *, poison, exclude=(), **changes):
    cfg = TrainConfig(**{**BASE, "output_dir": str(tmp_path / name), **changes})
    with Trainer(cfg) as trainer:
        trainer.collector = Poisoned(trainer.collector, poison=poison, exclude=exclude)
        metrics = trainer.train_step()
        if poison:
            assert trainer.collector.poisoned > 0
        weights = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
        return metrics, weights


@pytest.mark.parametrize("changes", [
    dict(shared_prefix=False, algorithm="ppo", rollout_correction="bypass"),  # padded rows; sampler log-probs as old; a critic
    # packed groups; reference KL; importance weights; an excluded trajectory with a NaN outcome in a group
    dict(shared_prefix=True, kl_coef=0.1, rollout_correction="is", exclude=(1,)),
    dict(prefix_tree=True, algorithm="gigpo"),  # the prefix tree; per-turn rewards in the step-group advantages
], ids=["padded-ppo-bypass", "packed-grpo-kl-is-excluded", "tree-gigpo"])
def test_garbage_at_positions_without_loss_changes_nothing(tmp_path, changes):
    clean, clean_weights = one_step(tmp_path, "clean", poison=False, **changes)
    dirty, dirty_weights = one_step(tmp_path, "dirty", poison=True, **changes)
    assert clean[names.ENV_TOKEN_SHARE] > 0  # environment tokens were among the poisoned positions
    for key in ("loss/total", "loss/policy", "grad_norm", "kl/ref_seq", "critic/grad_norm", "rollout/logp_gap_max"):
        if key in clean:
            assert torch.isfinite(torch.tensor(dirty[key])) and dirty[key] == clean[key], (key, clean[key], dirty[key])
    for k in clean_weights:
        assert torch.equal(clean_weights[k], dirty_weights[k]), k
