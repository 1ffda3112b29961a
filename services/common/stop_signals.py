"""SIGTERM and SIGINT handed to a thread, so that no lock is ever taken inside a signal handler.

A Python signal handler runs in the main thread between two of its bytecodes, possibly while that
thread holds a lock: inside ``threading.Event.wait``, for one, between taking its condition's lock
back after a timeout and letting it go. A handler that then calls ``Event.set`` waits for that
lock, which its own thread holds: the process hangs and never exits (a loader given SIGINT while
its main thread polled ``wait(0.5)`` did, once in a whole test run on a busy machine). So the
handler here only writes the signal's number into a pipe (a system call, no lock); a daemon thread
reads it and calls ``on_signal`` there, where taking locks is safe.

    with SignalListener(lambda signum: stop.set()):
        while not stop.wait(0.5):
            ...
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalListener:
    """While started (or entered): each of ``signums`` calls ``on_signal(signum)`` on the listener's thread, one
    at a time in the order they came. Stopping (leaving) restores the previous handlers. Main thread only
    (Python installs signal handlers there)."""

    def __init__(self, on_signal: Callable[[int], None], signums: tuple[int, ...] = STOP_SIGNALS) -> None:
        self.on_signal = on_signal
        self.signums = signums
        self._previous: dict[int, object] = {}
        self._write_fd = -1
        self._thread: threading.Thread | None = None

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        with contextlib.suppress(OSError):  # a full pipe: hundreds of signals already waiting
            os.write(self._write_fd, bytes((signum,)))

    def _listen(self, read_fd: int) -> None:
        try:
            while signums := os.read(read_fd, 64):  # b"" once the write end is closed
                for signum in signums:
                    self.on_signal(signum)
        finally:
            os.close(read_fd)

    def start(self) -> SignalListener:
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._thread = threading.Thread(target=self._listen, args=(read_fd,), name="signals", daemon=True)
        self._thread.start()
        self._previous = {s: signal.signal(s, self._handle) for s in self.signums}
        return self

    def stop(self) -> None:
        """Restore the handlers and end the thread; a second call does nothing (closing the
        pipe's number twice could close another file that took the number meanwhile)."""
        if self._write_fd < 0:
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        write_fd, self._write_fd = self._write_fd, -1
        os.close(write_fd)  # the thread reads what is left, then the end of the pipe
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> SignalListener:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
