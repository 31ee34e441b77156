"""The driver's loops: the run plan, the training loop split by concern (rollouts,
recovery, weight sync, store writes, evaluation, the run's log), and the collect-only and
preference loops on the same parts. Moves object references, never episode data."""
