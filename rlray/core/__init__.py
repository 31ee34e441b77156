"""The types that cross actor boundaries: the episode and its schema, step and eval stats,
prompts, the environment protocol, groups, checkpoints and evaluation math. No torch, Ray
or vLLM."""
