"""The OpenAI Responses wire: `POST /v1/responses` (the Agents SDK, Codex)."""
