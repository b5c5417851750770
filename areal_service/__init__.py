"""AReaL Service: OpenAI-compatible RL-as-a-service.

`areal_service` is the torch-free core: the one config tree, the wire types between hops,
keys, episodes (returns and training sequences) and the trajectory store package, which
owns every SQL statement. It imports none of its peers (`engine`, `gateway`, `trainer`)
nor the `launcher` above them, and no torch (tests/unit/test_layering.py checks both).
"""

__version__ = "0.1.0"
