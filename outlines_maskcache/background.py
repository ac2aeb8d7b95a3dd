"""Daemon threads for work that must stay off the decode path: store writes, and full compiles behind lazy Indexes.

Stock outlines pays nothing for a grammar store or a hand-over, so neither
may delay a first mask: what a caller submits here runs after it returns,
in submission order.  Daemon threads rather than an executor: the runtime
decides what exit waits for (``Runtime.settle``: the compiles a script
started, then the store writes, so that its next run finds them; stock
would have paid those compiles before its first mask anyway).  ``drain``
waits for a queue (tests, ``uninstall()``, ``precompile``, exit).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

log = logging.getLogger("outlines_maskcache")


class Background:
    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.Queue[tuple[str, Callable[[], Any]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: submitted and finished items (drain waits until they meet: work that submits work is waited for too)
        self._submitted = 0
        self._finished = 0
        self._idle = threading.Condition(self._lock)
        self.done = 0
        self.failed = 0

    def submit(self, what: str, work: Callable[[], Any]) -> None:
        """Run *work* later on the background thread; *what* names it in the log if it raises."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=f"outlines_maskcache-{self.name}", daemon=True)
                self._thread.start()
            self._submitted += 1
        self._queue.put((what, work))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until the thread is idle (what was submitted has run, and what that submitted); False on *timeout*."""
        if threading.current_thread() is self._thread:
            return False  # background work waiting for itself would never return
        with self._idle:
            return self._idle.wait_for(lambda: self._finished == self._submitted, timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:  # pragma: no cover - never sent; the thread dies with the process
                return
            what, work = item
            try:
                work()
                self.done += 1
            except Exception as err:  # noqa: BLE001 - background work is best-effort by design
                self.failed += 1
                log.warning("outlines_maskcache: background %s failed (%s: %s)", what, type(err).__name__, err)
            finally:
                with self._idle:
                    self._finished += 1
                    self._idle.notify_all()

    def after_fork(self) -> None:
        # The parent's thread does not exist in the child; its queued work belongs to the parent.
        self._queue = queue.Queue()
        self._thread = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._submitted = self._finished = 0

    def reset_counters(self) -> None:
        self.done = self.failed = 0
