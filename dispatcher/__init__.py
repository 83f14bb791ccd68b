"""trio-dispatcher: one OpenAI-compatible endpoint in front of your LLM nodes and providers."""
