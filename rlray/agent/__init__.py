"""The agent endpoint: an OpenAI-compatible API onto the policy, for agents written with
the `openai` client; their calls' exact tokens become the run's episodes."""
