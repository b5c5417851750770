"""The local inference engine: an HF-transformers server that speaks SGLang's native HTTP
API subset (`/generate` with streaming and logprobs, pause/continue, abort, disk weight
updates, info and health), so the gateway cannot tell it from SGLang; and the project's
tiny model (`tiny_model.py`), built here so nothing is downloaded.

A peer of `gateway/` and `trainer/`: it imports only the core. Kept import-light on
purpose: import the submodule you need (torch loads with `runner`).
"""
