"""SignalListener: a signal's callback runs on the listener's thread, so that it may take a lock
the main thread holds when the signal comes (a handler taking it in the main thread would wait
for itself forever); signals arrive in order; the previous handlers come back."""

from __future__ import annotations

import os
import signal
import threading

from services.common.stop_signals import SignalListener


def test_a_callback_may_take_a_lock_the_main_thread_holds_when_the_signal_comes():
    lock = threading.Lock()
    taken = threading.Event()

    def on_signal(_signum: int) -> None:
        with lock:
            taken.set()

    with SignalListener(on_signal, (signal.SIGUSR1,)):
        with lock:
            os.kill(os.getpid(), signal.SIGUSR1)
            total = sum(range(1000))  # bytecodes, between which the handler runs: the lock held
            assert total and not taken.wait(0.2)  # the callback waits for the lock, on its own thread
        assert taken.wait(5)


def test_signals_come_in_order_and_the_previous_handlers_come_back():
    seen: list[int] = []
    done = threading.Event()

    def on_signal(signum: int) -> None:
        seen.append(signum)
        if len(seen) == 3:
            done.set()

    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)
    with SignalListener(on_signal, (signal.SIGUSR1, signal.SIGUSR2)):
        for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGUSR1):
            os.kill(os.getpid(), signum)
        assert done.wait(5)
    assert seen == [signal.SIGUSR1, signal.SIGUSR2, signal.SIGUSR1]
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)) == before
