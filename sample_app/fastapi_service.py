"""The sample FastAPI service, under ``spanprof.ProfilingMiddleware``.

Endpoints, each doing its work in functions with telling names so they stand out in a flame
graph:

- ``POST /hash``: CPU-heavy: a key stretched with iterated SHA-256, then a pure-Python Feistel
  cipher over the request body (on the event loop, as much real code does);
- ``GET /fanout``: three shard queries at once (``asyncio.TaskGroup``; ``gather`` on 3.10);
- ``GET /report``: a synchronous report renderer in the thread pool (``run_in_threadpool``);
- ``GET /checkout``: calls the Flask inventory service over HTTP with the trace context, and
  now and then recomputes promotions for a long time, so the ``/checkout`` SLO breaches;
- ``WEBSOCKET /ws/echo``: checksums every text message;
- ``GET /health``.

Run it with ``uvicorn sample_app.fastapi_service:app`` (profiles and spans go where the
``PYROSCOPE_*`` and ``OTEL_*`` variables say) or ``spanprof dev sample_app.fastapi_service:app``
(everything local). ``SAMPLE_FLASK_URL`` is the inventory service (default
``http://127.0.0.1:8002``); ``SAMPLE_SLOW_SHARE`` the share of slow checkouts (default 0.1).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.concurrency import run_in_threadpool

import spanprof

from .telemetry import setup_telemetry

__all__ = [
    "app",
    "create_app",
    "encrypt_body",
    "recompute_promotions",
    "render_report",
    "score_documents",
    "stretch_key",
]

SERVICE_NAME = "sample-fastapi"
DEFAULT_FLASK_URL = "http://127.0.0.1:8002"
SHARDS = ("eu-west", "us-east", "ap-south")
MAX_BODY = 64 * 1024


# -- POST /hash: CPU on the event loop ---------------------------------------------------------


def stretch_key(secret: bytes, rounds: int) -> bytes:
    """A key from ``secret`` by iterated SHA-256 (the C half of the work)."""
    digest = hashlib.sha256(secret).digest()
    for _ in range(rounds):
        digest = hashlib.sha256(digest).digest()
    return digest


def _feistel_round(left: list[int], right: list[int], key: bytes, round_no: int) -> list[int]:
    mixed = []
    for i, byte in enumerate(right):
        k = key[(i + round_no) % len(key)]
        value = ((byte * 31) ^ k ^ (i * 7 + round_no)) & 0xFF
        mixed.append(left[i] ^ ((value << 3 | value >> 5) & 0xFF))
    return mixed


def encrypt_body(body: bytes, key: bytes, rounds: int = 4) -> bytes:
    """A toy Feistel cipher in pure Python over 32-byte blocks (the Python half of the work)."""
    out = bytearray()
    padded = body + b"\0" * (-len(body) % 32)
    for start in range(0, len(padded), 32):
        left, right = list(padded[start : start + 16]), list(padded[start + 16 : start + 32])
        for round_no in range(rounds):
            left, right = right, _feistel_round(left, right, key, round_no)
        out += bytes(left) + bytes(right)
    return bytes(out)


# -- GET /fanout: child tasks ---------------------------------------------------------------------


def score_documents(shard: str, query: str, documents: int) -> float:
    """Rank ``documents`` fake documents of ``shard`` against ``query`` (pure Python)."""
    digest = hashlib.blake2b(f"{shard}/{query}".encode(), digest_size=4).digest()
    rng = random.Random(int.from_bytes(digest, "big"))
    best = 0.0
    for _ in range(documents):
        words = [rng.random() for _ in range(8)]
        score = sum(w * w for w in words) / (1.0 + abs(words[0] - words[-1]))
        best = max(best, score)
    return best


async def query_shard(shard: str, query: str) -> dict[str, Any]:
    """One shard: a network-like wait, then scoring on the loop."""
    await asyncio.sleep(random.uniform(0.005, 0.03))
    return {"shard": shard, "score": round(score_documents(shard, query, 1500), 6)}


async def fan_out(query: str) -> list[dict[str, Any]]:
    """Query every shard at once; the labels follow each child task."""
    if sys.version_info >= (3, 11):
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(query_shard(shard, query)) for shard in SHARDS]
        return [task.result() for task in tasks]
    return list(await asyncio.gather(*(query_shard(shard, query) for shard in SHARDS)))


# -- GET /report: the thread pool ------------------------------------------------------------------


def render_report(rows: int, seed: int) -> str:
    """A CSV report, sorted and formatted in a worker thread (blocking code)."""
    rng = random.Random(seed)
    records = [(f"customer-{rng.randrange(10_000):05d}", rng.random() * 1000) for _ in range(rows)]
    records.sort(key=lambda record: (-record[1], record[0]))
    lines = ["customer,revenue,share"]
    total = sum(amount for _, amount in records) or 1.0
    lines += [f"{name},{amount:.2f},{amount / total:.6f}" for name, amount in records]
    return "\n".join(lines)


# -- GET /checkout: another service, and now and then a slow path ----------------------------


async def recompute_promotions(sku: str, quantity: int, cpu_seconds: float) -> float:
    """The occasional slow path: ``cpu_seconds`` of rule evaluation in short steps, yielding
    between them so other requests go on (and stretch this one's latency further)."""
    spent = 0.0
    discount = 0.0
    round_no = 0
    while spent < cpu_seconds:
        started = time.thread_time()
        discount = apply_coupon_rules(sku, quantity, round_no, discount)
        spent += time.thread_time() - started
        round_no += 1
        await asyncio.sleep(0)
    return discount


def apply_coupon_rules(sku: str, quantity: int, round_no: int, discount: float) -> float:
    """About 10 ms of rule evaluation."""
    rng = random.Random(hash((sku, quantity, round_no)))
    for _ in range(6000):
        rule = rng.random()
        if rule > 0.999:
            discount = max(discount, rule * quantity % 0.3)
    return discount


def price_cart(sku: str, quantity: int) -> float:
    """The normal, quick pricing."""
    base = (int(hashlib.sha256(sku.encode()).hexdigest()[:6], 16) % 5000) / 100
    return round(base * quantity, 2)


async def fetch_inventory(client: httpx.AsyncClient, base_url: str, sku: str) -> Any:
    """Ask the Flask service, in a CLIENT span whose context travels in the headers."""
    tracer = trace.get_tracer(__name__)
    with tracer.start_as_current_span("GET /inventory/<sku>", kind=SpanKind.CLIENT) as span:
        headers: dict[str, str] = {}
        propagate.inject(headers)  # traceparent: the Flask span becomes this span's child
        url = f"{base_url}/inventory/{sku}"
        span.set_attribute("http.request.method", "GET")
        span.set_attribute("url.full", url)
        try:
            response = await client.get(url, headers=headers)
        except httpx.HTTPError as exc:
            span.set_status(Status(StatusCode.ERROR, f"inventory unreachable: {exc!r}"))
            return None
        span.set_attribute("http.response.status_code", response.status_code)
        if response.status_code >= 400:
            span.set_status(Status(StatusCode.ERROR))
            return None
        return response.json()


# -- the app -------------------------------------------------------------------------------------


def create_app(
    *,
    flask_url: str | None = None,
    slow_share: float | None = None,
    environ: Mapping[str, str] = os.environ,
) -> FastAPI:
    """The FastAPI app wrapped by ``ProfilingMiddleware`` (SLOs from ``SPANPROF_*``)."""
    setup_telemetry(SERVICE_NAME, environ)
    inventory_url = (flask_url or environ.get("SAMPLE_FLASK_URL") or DEFAULT_FLASK_URL).rstrip("/")
    share = slow_share if slow_share is not None else float(environ.get("SAMPLE_SLOW_SHARE", "0.1"))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(timeout=5.0) as client:
            app.state.http = client
            yield

    app = FastAPI(title="spanprof sample (FastAPI)", lifespan=lifespan)
    app.add_middleware(spanprof.ProfilingMiddleware)

    @app.post("/hash")
    async def hash_body(request: Request, rounds: int = 4) -> dict[str, Any]:
        body = (await request.body())[:MAX_BODY] or b"spanprof"
        key = stretch_key(body[:64], 20_000)
        cipher = encrypt_body(body, key, max(1, min(rounds, 16)))
        return {"bytes": len(body), "digest": hashlib.sha256(cipher).hexdigest()}

    @app.get("/fanout")
    async def fanout(q: str = "flame graphs") -> dict[str, Any]:
        results = await fan_out(q)
        return {
            "query": q,
            "best": max(results, key=lambda r: float(r["score"])),
            "shards": results,
        }

    @app.get("/report")
    async def report(rows: int = 3000) -> dict[str, Any]:
        text = await run_in_threadpool(render_report, max(1, min(rows, 20_000)), rows)
        return {"rows": text.count("\n"), "bytes": len(text)}

    @app.get("/checkout")
    async def checkout(request: Request, sku: str = "sku-42", qty: int = 1) -> dict[str, Any]:
        quantity = max(1, min(qty, 100))
        stock = await fetch_inventory(request.app.state.http, inventory_url, sku)
        total = price_cart(sku, quantity)
        slow = random.random() < share
        if slow:
            total *= 1 - await recompute_promotions(sku, quantity, random.uniform(0.15, 0.3))
        return {"sku": sku, "total": round(total, 2), "inventory": stock, "promotions": slow}

    @app.websocket("/ws/echo")
    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        try:
            while True:
                text = await websocket.receive_text()
                digest = hashlib.sha256(stretch_key(text.encode(), 2000)).hexdigest()[:16]
                await websocket.send_text(f"{digest} {text}")
        except WebSocketDisconnect:
            return

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


app = create_app()
