"""A traffic generator for the sample FastAPI service, bounded in requests and in time.

```sh
python -m sample_app.traffic --base-url http://127.0.0.1:8000 --requests 500 --duration 60
```

``--concurrency`` clients send a mix of the service's endpoints (``/checkout``, ``/hash``,
``/fanout``, ``/report`` and, with the ``websockets`` package, ``/ws/echo``) until either bound
is reached, printing one progress line: requests sent, errors, and SLO breaches seen (latency
over the route's SLO, from ``--slo``/``--route-slo`` or ``SPANPROF_SLO_SECONDS``/
``SPANPROF_ROUTE_SLO``, as the service judges them).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

import httpx

__all__ = ["Progress", "main", "run"]

# (weight, route template, request maker)
_Request = Callable[[httpx.AsyncClient, random.Random], Awaitable[int]]


async def _checkout(client: httpx.AsyncClient, rng: random.Random) -> int:
    sku = f"sku-{rng.randrange(1, 60)}"
    response = await client.get("/checkout", params={"sku": sku, "qty": rng.randrange(1, 5)})
    return response.status_code


async def _hash(client: httpx.AsyncClient, rng: random.Random) -> int:
    body = rng.randbytes(rng.randrange(1024, 6144))
    response = await client.post("/hash", content=body)
    return response.status_code


async def _fanout(client: httpx.AsyncClient, rng: random.Random) -> int:
    query = rng.choice(("flame graphs", "exemplars", "span ids", "p99"))
    response = await client.get("/fanout", params={"q": query})
    return response.status_code


async def _report(client: httpx.AsyncClient, rng: random.Random) -> int:
    response = await client.get("/report", params={"rows": rng.randrange(1000, 4000)})
    return response.status_code


def _websocket_request(base_url: str) -> _Request | None:
    try:
        from websockets.asyncio.client import connect
    except ImportError:  # optional: without it the mix has no websocket sessions
        return None
    ws_url = "ws" + base_url.removeprefix("http") + "/ws/echo"

    async def echo(client: httpx.AsyncClient, rng: random.Random) -> int:
        async with connect(ws_url, open_timeout=5, close_timeout=2) as socket:
            for i in range(rng.randrange(2, 6)):
                await socket.send(f"message {i}")
                await socket.recv()
        return 101

    return echo


def _mix(base_url: str) -> list[tuple[float, str, _Request]]:
    mix: list[tuple[float, str, _Request]] = [
        (0.35, "/checkout", _checkout),
        (0.2, "/hash", _hash),
        (0.2, "/fanout", _fanout),
        (0.15, "/report", _report),
    ]
    websocket = _websocket_request(base_url)
    if websocket is not None:
        mix.append((0.1, "/ws/echo", websocket))
    return mix


def _parse_slos(default: str | None, routes: str | None) -> tuple[float, dict[str, float]]:
    env = os.environ
    default_s = float(default or env.get("SPANPROF_SLO_SECONDS") or 0.5)
    per_route: dict[str, float] = {}
    for part in (routes if routes is not None else env.get("SPANPROF_ROUTE_SLO", "")).split(","):
        route, sep, seconds = part.strip().rpartition("=")
        if sep and route:
            per_route[route.strip()] = float(seconds)
    return default_s, per_route


@dataclass
class Progress:
    """Counts of one run."""

    sent: int = 0
    errors: int = 0
    breaches: int = 0
    started: float = field(default_factory=time.monotonic)
    by_route: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        """The one-line summary the progress display rewrites."""
        elapsed = time.monotonic() - self.started
        return (
            f"traffic: {self.sent} sent  {self.errors} errors  {self.breaches} SLO breaches  "
            f"({elapsed:.0f} s)"
        )


async def run(
    base_url: str,
    *,
    requests: int,
    duration: float,
    concurrency: int,
    slo: tuple[float, Mapping[str, float]] = (0.5, {}),
    seed: int | None = None,
    pause: float = 0.2,
    out: TextIO | None = sys.stderr,
) -> Progress:
    """Send at most ``requests`` requests for at most ``duration`` seconds; return the counts."""
    progress = Progress()
    mix = _mix(base_url.rstrip("/"))
    weights = [weight for weight, _, _ in mix]
    default_slo, route_slos = slo
    deadline = time.monotonic() + duration
    budget = requests
    master = random.Random(seed)

    async def client_loop(rng: random.Random) -> None:
        nonlocal budget
        async with httpx.AsyncClient(base_url=base_url, timeout=10.0) as client:
            while budget > 0 and time.monotonic() < deadline:
                budget -= 1
                _, route, send = rng.choices(mix, weights)[0]
                started = time.perf_counter()
                try:
                    status = await send(client, rng)
                except Exception:
                    status = 0
                latency = time.perf_counter() - started
                progress.sent += 1
                progress.by_route[route] = progress.by_route.get(route, 0) + 1
                if status == 0 or status >= 400:
                    progress.errors += 1
                elif latency > route_slos.get(route, default_slo):
                    progress.breaches += 1
                if pause:
                    await asyncio.sleep(rng.uniform(0, 2 * pause))

    async def report() -> None:
        while True:
            if out is not None:
                out.write("\r" + progress.line() + "   ")
                out.flush()
            await asyncio.sleep(0.5)

    reporter = asyncio.ensure_future(report())
    try:
        clients = [client_loop(random.Random(master.random())) for _ in range(concurrency)]
        await asyncio.gather(*clients)
    finally:
        reporter.cancel()
        if out is not None:
            out.write("\r" + progress.line() + "   \n")
            out.flush()
    return progress


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sample_app.traffic``."""
    parser = argparse.ArgumentParser(prog="python -m sample_app.traffic", description=__doc__)
    parser.add_argument(
        "--base-url", "--url", dest="base_url", default="http://127.0.0.1:8000",
        help="the FastAPI service (default http://127.0.0.1:8000)",
    )  # fmt: skip
    parser.add_argument("--requests", type=int, default=10_000, help="at most this many requests")
    parser.add_argument("--duration", type=float, default=600.0, help="at most this many seconds")
    parser.add_argument("--concurrency", type=int, default=4, help="concurrent clients")
    parser.add_argument("--slo", help="SLO seconds (default SPANPROF_SLO_SECONDS, else 0.5)")
    parser.add_argument("--route-slo", help="per-route SLOs, '/checkout=0.25,/search=1'")
    parser.add_argument(
        "--pause", type=float, default=0.2,
        help="mean think time of a client between requests, seconds (default 0.2)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, help="random seed for a repeatable mix")
    args = parser.parse_args(argv)
    if args.requests < 0 or args.duration <= 0 or args.concurrency < 1 or args.pause < 0:
        parser.error("--requests >= 0, --duration > 0, --concurrency >= 1, --pause >= 0")
    try:
        slo = _parse_slos(args.slo, args.route_slo)
    except ValueError as exc:
        parser.error(f"--slo/--route-slo: {exc}")
    try:
        progress = asyncio.run(
            run(
                args.base_url,
                requests=args.requests,
                duration=args.duration,
                concurrency=args.concurrency,
                slo=slo,
                seed=args.seed,
                pause=args.pause,
            )
        )
    except KeyboardInterrupt:
        return 130  # the progress line was finished when the run was cancelled
    return 1 if progress.sent and progress.errors == progress.sent else 0


if __name__ == "__main__":
    sys.exit(main())
