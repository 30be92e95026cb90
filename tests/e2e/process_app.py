"""An app whose requests start processes, served with the default profiler (``SPANPROF_PROFILER``
unset): ``GET /pool/{method}`` runs jobs in a ``ProcessPoolExecutor`` of that start method
(``fork``, ``spawn``, ``forkserver``) and one ``multiprocessing.Process``, each job allocating
and burning CPU, then burns 0.1 s of CPU itself; the response says what the children returned
and how the process exited.

The request's process carries the profiler's signal handler, its timer, its allocation hooks and
its threads when the children start: none of it may reach a child's result or its exit.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from spanprof import ProfilingMiddleware

trace.set_tracer_provider(TracerProvider())


def job(seconds: float) -> tuple[int, int]:
    """Allocate and burn ``seconds`` of CPU; return this process's id and what it kept."""
    end = time.thread_time() + seconds
    kept: list[bytes] = []
    while time.thread_time() < end:
        kept.append(bytes(1000))
        del kept[:-100]
    return os.getpid(), len(kept)


def _process(method: str) -> int | None:
    context = multiprocessing.get_context(method)
    assert isinstance(context, ForkContext | SpawnContext | ForkServerContext)
    child = context.Process(target=job, args=(0.05,))
    child.start()
    child.join(60)
    exitcode: int | None = child.exitcode
    return exitcode


async def pool(request: Request) -> Response:
    method = request.path_params["method"]
    context = multiprocessing.get_context(method)
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(2, mp_context=context) as executor:
        results = await asyncio.gather(
            *(loop.run_in_executor(executor, job, 0.05) for _ in range(4))
        )
    # From the loop thread, where the profiler's timer signals (a fork from a thread-pool
    # worker exits 1 whatever the profiler: concurrent.futures' exit hook, in the child).
    exitcode = _process(method)
    job(0.1)  # and CPU of its own, in the server: its span's samples
    return JSONResponse(
        {"server": os.getpid(), "children": [pid for pid, _ in results],
         "kept": [n for _, n in results], "exitcode": exitcode}
    )  # fmt: skip


async def health(request: Request) -> Response:
    return PlainTextResponse("ok")


app = ProfilingMiddleware(
    Starlette(routes=[Route("/pool/{method}", pool), Route("/health", health)])
)
