"""The learners: the Engine (its settings, models, batches, optimizer offload and
checkpoints beside it), the learner group (FSDP2), LoRA, and the RL, preference (DPO/IPO)
and reward-model learners."""
