"""A command's process ends with its objects frozen (effitrain.util.process_exit): its value and its
exit code are the entry point's, and its exit handlers and buffered output still run."""

from __future__ import annotations

import subprocess
import sys

ENDED = """
import atexit, gc, sys
from effitrain.util.process_exit import run_then_end

gc.unfreeze()
tracked = len(gc.get_objects())

def entry(path, code):
    atexit.register(lambda: open(path, "a").write("exit handler ran\\n"))
    sys.stdout.write("buffered, ")
    if code:
        raise SystemExit(code)
    return 3

value = run_then_end(entry, sys.argv[1], int(sys.argv[2]))
print(value, gc.get_freeze_count() >= tracked)
"""


def test_the_entry_s_value_or_exit_code_stands_its_objects_frozen_and_its_exit_handlers_run(tmp_path):
    log = tmp_path / "log"
    done = subprocess.run([sys.executable, "-c", ENDED, str(log), "0"], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "buffered, 3 True\n"), done.stderr
    assert log.read_text() == "exit handler ran\n"
    failed = subprocess.run([sys.executable, "-c", ENDED, str(log), "2"], capture_output=True, text=True)
    assert (failed.returncode, failed.stdout) == (2, "buffered, ")
    assert log.read_text() == "exit handler ran\n" * 2
