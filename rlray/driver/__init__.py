"""The driver's loops: the job skeleton every job runs in, the run plan, the training
loop split by concern (steps, rollouts, recovery, weight sync, store writes, evaluation,
the run's log), and the collect-only and preference loops on the same parts. Moves
object references, never episode data."""
