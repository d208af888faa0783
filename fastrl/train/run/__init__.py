"""The run's housekeeping: what a training run holds around its loop, not a stage of the step.

Its rooms: ``interrupt`` (signals and the stop requests), ``threads`` (the thread rule and its
governor), ``hub`` (hub-id checks), ``heap`` (mmap of large blocks), ``faults`` (the divergence
and disk-full messages), ``checkpoint`` (the run's checkpoints and resume) with ``manifest`` (a
checkpoint's sizes and hashes) and ``warmup_checkpoint`` (a stopped warm-up's state),
``progress`` (progress bars) and ``metrics`` (the loggers and stage timers). The output folder's
lock and default folders stay in ``fastrl.train.rundir``: ``TrainConfig`` picks the default
folder, and ``progress`` reads ``TrainConfig``, so here they would import each other.
"""
