"""A deterministic learning test: the embedded default task, a fixed seed, a small budget.

After the warm-up (stopped at 30% greedy accuracy on training problems), GRPO must raise
held-out greedy accuracy clearly. CPU runs are bit-for-bit reproducible for a given machine
and thread count; the margin below is far from the observed gain, so float differences
between machines cannot flip it.
"""

import json

from fastrl.train import TrainConfig
from fastrl.train.sft import ProbeSchedule
from fastrl.train.trainer import Trainer


def test_grpo_raises_held_out_accuracy_on_the_default_task(tmp_path, one_thread):
    cfg = TrainConfig(
        seed=1, steps=30, eval_every=30, eval_prompts=100, pass_k=1, task_eval_size=100, output_dir=str(tmp_path / "run"),
        progress=False, tensorboard=False, reward_workers=0,
    )
    with Trainer(cfg) as trainer:
        result = trainer.train()
    before, after = result.first_eval["eval/accuracy"], result.last_eval["eval/accuracy"]
    sft = trainer.warmup.metrics
    print(json.dumps({"before": before, "after": after, **sft}))
    assert sft["sft/probe_accuracy"] >= 0.3
    # the probes came when ProbeSchedule said (every sft_check_every steps), and the run's log has them
    probes = trainer.warmup.probes
    assert len(probes) == sft["sft/probes"] and probes[-1] == (sft["sft/steps"], sft["sft/probe_accuracy"])
    schedule = ProbeSchedule(trainer.cfg.sft_check_every, trainer.cfg.sft_target_accuracy,
                             sooner_near_target=trainer.cfg.sft_probe_sooner)
    assert probes[0][0] == schedule.next_at
    for (step, acc), (next_step, _) in zip(probes, probes[1:]):
        assert not schedule.reached(step, acc) and next_step == schedule.next_at
    assert schedule.reached(*probes[-1])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = next(m for m in records if "sft/steps" in m)
    assert logged["probes"] == [[s, a] for s, a in probes]
    assert after >= before + LEARNING_MARGIN, (before, after)


LEARNING_MARGIN = 0.10
