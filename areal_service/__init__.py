"""AReaL Service: OpenAI-compatible RL-as-a-service.

`areal_service` is the shared core (config, store, wire types, CLI, local engine).
It must not import `gateway` or `trainer`; they import it.
"""

__version__ = "0.1.0"
