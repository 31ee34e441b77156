"""What a run reads: prompt sources, chat rendering, the built-in tasks, the tiny models
built offline, model-path checks and preference pairs."""
