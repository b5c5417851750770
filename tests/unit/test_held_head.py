"""`HeldHead`: a reply's status line and headers leave with its first body bytes (one
socket send per JSON reply), and are never held past the loop's next iteration."""

from __future__ import annotations

import asyncio

from gateway.connections import HeldHead


class Recording:
    """The connection's transport, as far as these tests look at it: what was written,
    in order, and whether it was closed."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_head_and_body_go_out_in_one_write() -> None:
    async def main() -> list[bytes]:
        raw = Recording()
        held = HeldHead(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        held.write(b"HTTP/1.1 200 OK\r\n\r\n")
        held.write(b"{}")
        held.write(b"more")  # later writes pass straight through
        await asyncio.sleep(0)
        return raw.writes

    assert asyncio.run(main()) == [b"HTTP/1.1 200 OK\r\n\r\n{}", b"more"]


def test_a_head_without_a_body_is_sent_at_the_next_iteration() -> None:
    async def main() -> tuple[list[bytes], list[bytes], list[bytes]]:
        raw = Recording()
        held = HeldHead(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        held.write(b"head")
        before = list(raw.writes)
        await asyncio.sleep(0)
        after = list(raw.writes)
        held.write(b"body")
        return before, after, raw.writes

    assert asyncio.run(main()) == ([], [b"head"], [b"head", b"body"])


def test_close_sends_what_is_held_first() -> None:
    async def main() -> Recording:
        raw = Recording()
        held = HeldHead(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        held.write(b"head")
        assert not held.is_closing()  # the rest is the connection's transport
        held.close()
        await asyncio.sleep(0)
        return raw

    raw = asyncio.run(main())
    assert raw.writes == [b"head"] and raw.closed
