"""The end-to-end client: batches of concurrent requests, each to its own marker."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

__all__ = ["fire"]


async def fire(
    base: str, *, concurrency: int, rounds: int = 1, timeout: float = 120.0
) -> dict[int, Any]:
    """``rounds`` batches of ``concurrency`` concurrent ``GET /burn/{index}``, one batch after
    the other, each request with its own index (so its own marker); their JSON by index."""
    reports: dict[int, Any] = {}
    async with httpx.AsyncClient(base_url=base, timeout=timeout) as client:
        for first in range(0, rounds * concurrency, concurrency):
            indexes = range(first, first + concurrency)
            responses = await asyncio.gather(*(client.get(f"/burn/{i}") for i in indexes))
            for index, response in zip(indexes, responses, strict=True):
                response.raise_for_status()
                reports[index] = response.json()
    return reports
