"""gunicorn hooks for the end-to-end servers (``-c tests/e2e/gunicorn_conf.py``)."""

from __future__ import annotations

import threading
import time
from typing import Any


def _background() -> None:
    from tests.e2e.markers import background_burn

    while True:
        background_burn(0.002)
        time.sleep(0.02)


def post_worker_init(worker: Any) -> None:
    """Each worker, once ready (gevent-patched), burns unlabelled CPU next to the requests.

    Under the gevent worker this thread is a greenlet of the worker's one OS thread: its
    samples stay unlabelled only if greenlet switches keep labels exact.
    """
    threading.Thread(target=_background, name="e2e-background", daemon=True).start()


# gunicorn >= 25.1 opens a control socket at one fixed path per user; concurrent test servers
# would share it. Older versions ignore the unknown setting.
control_socket_disable = True
