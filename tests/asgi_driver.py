"""Minimal ASGI drivers for lifespan and websocket sessions (httpx speaks plain HTTP only)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from spanprof._types import ASGIApp, Message


@asynccontextmanager
async def lifespan(app: ASGIApp) -> AsyncIterator[None]:
    """Run ``app``'s lifespan: startup on enter, shutdown on exit, failing on ``*.failed``."""
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    outbox: asyncio.Queue[Message] = asyncio.Queue()

    async def receive() -> Message:
        return await inbox.get()

    async def send(message: Message) -> None:
        await outbox.put(message)

    async def run() -> None:
        await app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)

    task = asyncio.create_task(run())
    await inbox.put({"type": "lifespan.startup"})
    started = await outbox.get()
    assert started["type"] == "lifespan.startup.complete", started
    try:
        yield
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        stopped = await outbox.get()
        assert stopped["type"] == "lifespan.shutdown.complete", stopped
        await task


async def websocket_session(
    app: ASGIApp, path: str, incoming: list[str] | None = None
) -> list[dict[str, Any]]:
    """Connect, send ``incoming`` texts, and collect what the app sends until it closes."""
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    await inbox.put({"type": "websocket.connect"})
    for text in incoming or []:
        await inbox.put({"type": "websocket.receive", "text": text})
    sent: list[dict[str, Any]] = []
    closed = asyncio.Event()

    async def receive() -> Message:
        if closed.is_set() and inbox.empty():
            return {"type": "websocket.disconnect", "code": 1000}
        return await inbox.get()

    async def send(message: Message) -> None:
        if message["type"] == "websocket.send":
            sent.append(dict(message))
        elif message["type"] == "websocket.close":
            closed.set()

    scope = {
        "type": "websocket",
        "asgi": {"version": "3.0"},
        "scheme": "ws",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"test")],
        "server": ("test", 80),
        "client": ("127.0.0.1", 1234),
        "subprotocols": [],
    }
    await app(scope, receive, send)
    return sent
