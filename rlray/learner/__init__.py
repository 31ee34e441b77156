"""The learners: the Engine (models, devices, optimizer, checkpoints), the learner group
(FSDP2), LoRA, and the RL, preference (DPO/IPO) and reward-model learners."""
