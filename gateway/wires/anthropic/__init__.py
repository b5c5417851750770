"""The Anthropic Messages wire: `POST /v1/messages` (Claude Code, the `anthropic` SDKs)."""
