"""The OpenAI-compatible gateway: routes, translation to token ids, backend client."""
