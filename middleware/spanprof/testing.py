"""Test helpers for applications that use spanprof: which labels did each piece of code run with?

```python
import spanprof.testing

def test_checkout_is_labelled(client):
    with spanprof.testing.record_labels() as recorder:
        client.get("/checkout")
    assert any(labels["span_name"] == "GET /checkout" for labels in recorder.labels_seen)
```

``record_labels`` plugs a ``RecorderBackend`` into the label engine for the block and restores
whatever backend was installed before, so the labels a profiler would have attached to every
sample of the block can be asserted on without a profiler.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ._labels._engine import install_label_engine, installed_backend, uninstall_label_engine
from ._labels._recorder import RecorderBackend

__all__ = ["RecorderBackend", "record_labels"]


@contextmanager
def record_labels(*, max_switches: int = 100_000) -> Iterator[RecorderBackend]:
    """Record every label switch of every thread while the block runs.

    Yields the ``RecorderBackend`` the label engine feeds: ``labels_seen`` lists the label sets
    code ran with, ``switches`` every ``(thread id, labels)`` switch, ``labelled_threads()``
    the threads still labelled (empty when nothing leaked). The previously installed backend,
    if any, is reinstalled afterwards.

    Arguments:
        max_switches: how many switches to keep (oldest dropped first).
    """
    previous = installed_backend()
    recorder = RecorderBackend(max_switches=max_switches)
    install_label_engine(recorder)
    try:
        yield recorder
    finally:
        if installed_backend() is recorder:
            uninstall_label_engine()
        if previous is not None:
            install_label_engine(previous)
