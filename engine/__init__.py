"""The local inference engine: an HF-transformers server that speaks SGLang's native HTTP
API subset (`/generate` with streaming and logprobs, pause/continue, abort, disk weight
updates, info and health), so the gateway cannot tell it from SGLang.

Modules: `protocol` (wire models), `runner` (model, batch KV cache, sampling),
`scheduler` (the engine thread: queue, continuous batching, pause, swaps), `server`
(FastAPI app, `create_engine_app`, `run_engine`), `testing` (loopback server fixture).
Kept import-light on purpose: import the submodule you need (torch loads with `runner`).
"""
