"""HTTP routes of the gateway, one module per surface (OpenAI, admin, health)."""
