"""How a command's process ends: its entry point runs, then every object it still holds is moved out of
the garbage collector's sight (``gc.freeze``), so the interpreter's shutdown does not walk the hundreds
of thousands of objects torch and transformers made at import once more (about a second of every
``train.py``, ``effitrain`` and sweep job process, measured by ``python benchmarks/process_exit.py``).

What the shutdown still does is unchanged: ``atexit`` handlers (logging, multiprocessing's children,
``weakref.finalize``), objects freed by their last reference, the standard streams flushed. Only
garbage in reference cycles is no longer collected on the way out: every file effitrain writes is
closed where it is written (``with``, :mod:`effitrain.util.atomic`). Called in a process's
``__main__`` only: frozen objects are never freed, which a test process calling ``main()`` in-process
must not pay."""

from __future__ import annotations

import gc


def run_then_end(entry, *args):
    """``entry(*args)``, its return value or exception passed on; then the garbage collector's objects
    frozen for the exit that follows (:mod:`effitrain.util.process_exit`)."""
    try:
        return entry(*args)
    finally:
        gc.freeze()
