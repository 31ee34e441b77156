"""A simulated engine and learner for control-plane benchmarks only (rollout.backend and
learner.backend simulated; docs/scale.md): no model, no vLLM and no torch; episodes and
weights from seeds and versions, and the time a profile of published rates models for
each call. Tests and training use the real engine."""
