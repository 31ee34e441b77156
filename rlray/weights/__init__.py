"""Weights on their way from the learner to the rollout engines: packing for the object
store, and vLLM's weight-transfer engine (NCCL, or gloo on CPU)."""
