"""The agent endpoint: an OpenAI-compatible API onto the policy, for agents written with
the `openai` client (issue 28; so far the API's requests and responses)."""
