"""How a run ends: SIGTERM raises like Ctrl-C (:func:`interrupts_raise`), so the run records it
(:meth:`effitrain.run.summary.Summary.recording`); an error as one line (:func:`one_line`)."""

from __future__ import annotations

import contextlib
import signal


class Interrupted(BaseException):
    """SIGTERM (a scheduler, ``kill``) arrived: handled like Ctrl-C, so the run records it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def interrupts_raise():
    """SIGTERM raises :class:`Interrupted` in the main thread for the duration (Ctrl-C already
    raises KeyboardInterrupt), so ``run`` writes an ``interrupted`` summary before exiting."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}"[:2000]
