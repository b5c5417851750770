"""A byte relay: the least a Python (uvloop) process can do per streamed token.

Each accepted connection gets its own connection to the target; bytes are copied both
ways as they arrive (`data_received` -> `transport.write`), with no parsing at all. The
`stream-pace` preset of `gateway_overhead` sends the direct load through it and measures
its CPU like a gateway's: its CPU per streamed token is the floor of any gateway that
forwards each token as it comes, written in Python on this event loop (one wake-up, one
socket read and one socket write per token).

Run: `python -m benchmarks.tcp_relay --port P --to HOST:PORT` (a child of the benchmark).
"""

from __future__ import annotations

import argparse
import asyncio

import uvloop


class _Pipe(asyncio.Protocol):
    """One side of a relayed connection; `peer` is the other side's transport."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: asyncio.Transport | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.peer is None:  # the other side is still connecting
            self.pending.append(data)
        else:
            self.peer.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None:
            self.peer.close()

    def attach(self, peer: asyncio.Transport) -> None:
        self.peer = peer
        for data in self.pending:
            peer.write(data)
        self.pending.clear()


async def relay(port: int, host: str, target_port: int) -> None:
    loop = asyncio.get_running_loop()

    def accepted() -> _Pipe:
        client = _Pipe()

        async def connect() -> None:
            try:
                transport, upstream = await loop.create_connection(_Pipe, host, target_port)
            except OSError:
                if client.transport is not None:
                    client.transport.close()
                return
            assert client.transport is not None
            if client.transport.is_closing():  # the client left while this connected
                transport.close()
                return
            upstream.attach(client.transport)
            client.attach(transport)  # type: ignore[arg-type]

        loop.create_task(connect())
        return client

    server = await loop.create_server(accepted, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--to", required=True, help="HOST:PORT to relay to")
    args = p.parse_args()
    host, _, port = args.to.rpartition(":")
    uvloop.run(relay(args.port, host, int(port)))


if __name__ == "__main__":
    main()
