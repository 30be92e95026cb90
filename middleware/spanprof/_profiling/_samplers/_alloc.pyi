"""Type stub of the optional C extension ``spanprof._profiling._samplers._alloc`` (``_alloc.c``)."""

from contextvars import ContextVar
from types import CodeType, FrameType
from typing import Any

#: One sample: (id, size, tracked, labels, codes, lastis, truncated, key, objects, bytes); the
#: stack is leaf first, and ``key`` is the same stack as bytes (each frame's code address and
#: offset). codes and lastis are None when ``drain``'s ``known`` has the key. objects and bytes
#: are what the sample stands for; tracked says its block is still in use. Samples of blocks no
#: longer in use come one per stack and labels object, their estimates summed.
RawSample = tuple[
    int,
    int,
    bool,
    object,
    tuple[CodeType, ...] | None,
    tuple[int, ...] | None,
    bool,
    bytes,
    float,
    float,
]

def unsupported() -> str | None:
    """Why allocation sampling cannot run in this interpreter, or None when it can."""

def start(
    labels_var: ContextVar[Any],
    mean_bytes: float,
    max_samples: int,
    max_tracked: int,
    max_frames: int,
    mem_domain: bool,
    seed: int,
    labelset_type: type | None = None,
    span_key: str | None = None,
    filter_bits: int = 0,
    /,
) -> None:
    """Install the hooks and sample about one block per ``mean_bytes`` allocated."""

def take_span(span_id: str, /) -> int:
    """The bytes the samples labelled ``span_id`` stand for since start(), rounded; forgets them."""

def stop() -> bool:
    """Put the previous allocators back; False when another hook sits over these."""

def drain(known: dict[bytes, Any] | None = None, /) -> tuple[list[RawSample], list[int]]:
    """The samples taken, and the ids of tracked samples (drained earlier) freed, since the
    last call; a sample whose stack key is in ``known`` comes without its frames (codes and
    lastis None)."""

def ignore_thread(ignore: bool, /) -> bool:
    """Leave the calling thread's allocations unsampled (or not); returns the previous setting."""

def ignore_leaf(code: CodeType | None, /) -> None:
    """Leave unsampled the allocations made while ``code`` runs in the leaf Python frame."""

def check_hooks() -> bool:
    """Whether sampling stopped because a hook was cut out of its allocator chain since start()."""

def stats() -> dict[str, int]:
    """Counters since start()."""

def allocator(domain: int, /) -> tuple[int, int, int, int, int]:
    """Opaque numbers for the allocator installed on ``domain`` (0 RAW, 1 MEM, 2 OBJ): its
    ctx, malloc, calloc, realloc and free addresses."""

def addr2line(code: CodeType, lasti: int, /) -> int:
    """The source line of byte offset ``lasti`` in ``code``."""

def stack_key(frame: FrameType, max_frames: int, /) -> bytes | None:
    """The stack from ``frame`` out (at most ``max_frames``) as code addresses and offsets;
    ``None`` for a frame that has returned."""

def timer_arm(timer_id: int, value_ns: int, interval_ns: int, /) -> bool:
    """``timer_settime`` on 64-bit Linux (absent elsewhere); False if the kernel refused."""

def stack_frame_ids(
    frame: FrameType, max_frames: int, frame_ids: dict[tuple[int, int], int], /
) -> tuple[int, ...] | list[int | tuple[CodeType, int, int]] | None:
    """The stack from ``frame`` out as the ids ``frame_ids`` maps ``(id(code), lasti)`` to; a
    list with ``(code, lasti, line)`` where a frame has none; ``None`` for a returned frame."""
