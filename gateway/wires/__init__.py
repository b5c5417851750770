"""The wire formats the gateway speaks, one room each: `chat` (OpenAI Chat Completions),
`responses` (OpenAI Responses), `anthropic` (Anthropic Messages). Every room has the same
files: `protocol` (request and reply models), `translate` (wire request -> our chat
messages and tools), `encode` (our reply and stream deltas -> the wire's body and
events) and `routes` (the pipeline adapter, its hot routes, its `/openapi.json` entry).

Shared by the rooms: `choice_stream` (a choice's tokens -> deltas), `blocks` (deltas ->
the ordered block events the Responses and Anthropic encoders shape), `common` (SSE
framing, the reasoning signer) and `routes` (every room's hot routes together).
"""
