"""The OpenAI Chat Completions wire: `POST /v1/chat/completions`."""
