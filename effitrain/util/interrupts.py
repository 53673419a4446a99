"""How a run is stopped: SIGTERM raises like Ctrl-C (:func:`interrupts_raise`), so the run records it
(:meth:`effitrain.run.summary.Summary.recording`); and either signal is remembered, because Python
drops an exception raised where a destructor or a weakref callback runs (the handler runs there too):
the training loop raises it again at the end of the step (:func:`raise_if_interrupted`)."""

from __future__ import annotations

import contextlib
import signal

_received: list[int] = []  # the signals that arrived while interrupts_raise was in force


class Interrupted(BaseException):
    """SIGTERM (a scheduler, ``kill``) arrived: handled like Ctrl-C, so the run records it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise(signum: int):
    raise KeyboardInterrupt if signum == signal.SIGINT else Interrupted(signum)


@contextlib.contextmanager
def interrupts_raise():
    """For the duration, SIGTERM raises :class:`Interrupted` in the main thread and Ctrl-C
    KeyboardInterrupt, each remembered, so ``run`` writes an ``interrupted`` summary before exiting."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        _received.append(signum)
        _raise(signum)

    _received.clear()
    mine = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # a background job's stays ignored
        mine.append(signal.SIGINT)
    previous = {signum: signal.signal(signum, handler) for signum in mine}
    try:
        yield
    finally:
        for signum, earlier in previous.items():
            signal.signal(signum, earlier)
        _received.clear()


def raise_if_interrupted() -> None:
    """Raise the signal that arrived while the run went on: its first raise was lost."""
    if _received:
        _raise(_received[0])


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}"[:2000]
