"""The commands that are programs of their own, beside the trainer they drive.

``compare`` (``fastrl compare``: RL algorithms side by side at an equal budget over seeds, each run
a fresh ``fastrl train`` process), ``plan`` (``fastrl plan``: the peak memory of a training step,
component by component, before running it) and ``paired`` (the paired per-row view of two
evaluations of the same held-out rows, used by the seed studies in ``benchmarks/``). They use the
trainer (``fastrl.train``); nothing in the trainer uses them.
"""
