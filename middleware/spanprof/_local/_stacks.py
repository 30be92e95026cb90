"""Kept stacks, shared by local mode's stores: cut to a depth, frames shared, trees for d3.

Anything on the machine can push to local mode, so a store keeps what it receives bounded by
bytes: stacks deeper than ``max_depth`` keep their leaf and root ends around a marker frame,
names are cut at ``MAX_NAME`` characters, and frames are stored once however many stacks (of
however many uploads) use them. ``FramePool`` does that and estimates what its frames cost;
``stack_cost`` estimates a kept stack; ``flame_tree`` turns stacks into a d3-flame-graph tree,
and ``descend`` walks a stack into such a tree (the breach comparison builds its own kind).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .._profiling._encoders._pprof import cut_stack
from .._profiling._window import Frame

__all__ = ["MAX_NAME", "TRUNCATED", "FramePool", "descend", "flame_tree", "stack_cost"]

#: Longer than any real function, file or span name; an upload's strings can be megabytes.
MAX_NAME = 1024
#: The stack that stands for the stacks of a span past its per-span limit.
TRUNCATED = (Frame("[truncated]", "", 0),)
# CPython sizes, rounded up: what one more kept thing costs (tuple or dict slot, objects).
_STACK_OVERHEAD = 160
_FRAME_OVERHEAD = 300


def stack_cost(stack: tuple[Frame, ...]) -> int:
    """Estimated bytes of one more kept stack (its tuple and dict slot; frames are shared)."""
    return _STACK_OVERHEAD + 8 * len(stack)


def _frame_cost(frame: Frame) -> int:
    return _FRAME_OVERHEAD + len(frame.function) + len(frame.filename)


class FramePool:
    """The frames of the stacks a store keeps, each stored once, and their estimated bytes.

    Arguments:
        max_depth: frames kept per stack (see ``keep``); at least 3.
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 3:
            raise ValueError(
                f"max_depth: expected at least 3 (leaf, marker, root), got {max_depth}"
            )
        self.max_depth = max_depth
        self._frames: dict[Frame, Frame] = {}
        #: Estimated bytes of the frames kept (dropped stacks' frames until ``compact``).
        self.bytes = 0

    def keep(self, stack: tuple[Frame, ...]) -> tuple[Frame, ...]:
        """``stack`` cut to ``max_depth``, its names to ``MAX_NAME``, its frames shared.

        A deeper stack keeps its leaf and root ends and an ``[N frames elided]`` frame between.
        """
        frames = self._frames
        out = []
        for frame in cut_stack((stack,), self.max_depth):
            shared = frames.get(frame)
            if shared is None:
                if len(frame.function) > MAX_NAME or len(frame.filename) > MAX_NAME:
                    frame = Frame(frame.function[:MAX_NAME], frame.filename[:MAX_NAME], frame.line)
                shared = frames.setdefault(frame, frame)
                if shared is frame:
                    self.bytes += _frame_cost(frame)
            out.append(shared)
        return tuple(out)

    def compact(self, stacks: Iterable[tuple[Frame, ...]]) -> None:
        """Forget the frames none of ``stacks`` (everything still kept) refers to."""
        # Kept frames are already shared, so identity finds them without hashing each one
        # (a Frame's hash is computed in Python, field by field).
        by_id: dict[int, Frame] = {}
        for stack in stacks:
            for frame in stack:
                by_id[id(frame)] = frame
        self._frames = {frame: frame for frame in by_id.values()}
        self.bytes = sum(_frame_cost(f) for f in self._frames)


def _node(name: str, filename: str) -> dict[str, Any]:
    return {"name": name, "file": filename, "value": 0, "children": {}}


def descend(
    node: dict[str, Any],
    stack: tuple[Frame, ...],
    make: Callable[[str, str], dict[str, Any]],
) -> Iterator[dict[str, Any]]:
    """The nodes of leaf-first ``stack`` under ``node``, root end first.

    A node's ``children`` map ``(function, filename)`` to nodes; a missing one is made by
    ``make(function, filename)`` on the way down.
    """
    for frame in reversed(stack):
        children = node["children"]
        key = (frame.function, frame.filename)
        child = children.get(key)
        if child is None:
            child = children[key] = make(frame.function, frame.filename)
        yield child
        node = child


def flame_tree(name: str, stacks: Iterable[tuple[tuple[Frame, ...], int]]) -> dict[str, Any]:
    """A d3-flame-graph tree (``name``, ``file``, ``value``, ``children``) of leaf-first stacks.

    Children are sorted by value, largest first; ``value`` is in whatever unit ``stacks`` are.
    """
    root = _node(name, "")
    for stack, value in stacks:
        root["value"] += value
        for node in descend(root, stack, _node):
            node["value"] += value
    # Iterative: a stack is as deep as the interpreter lets a program recurse, far deeper than
    # this function could recurse over it.
    todo = [root]
    while todo:
        node = todo.pop()
        children = sorted(node["children"].values(), key=lambda c: (-c["value"], c["name"]))
        node["children"] = children
        todo.extend(children)
    return root
