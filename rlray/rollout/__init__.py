"""Generation: the vLLM rollout worker, multi-turn rollouts token in and token out,
environments, tools and sampling settings."""
