"""Library log lines a user should not see, or not in that form: filters installed on import."""

from __future__ import annotations

import logging
import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _BitsandbytesKernels(logging.Filter):
    """bitsandbytes warns on every import that its optional 4-bit CPU kernels are missing; effitrain
    never uses 4-bit layers, so the line is noise in every job's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "gemm_4bit_forward" not in record.getMessage()


class _LoadReport(logging.Filter):
    """transformers' weight-loading report is a coloured table (raw escape codes in a log file) that
    every classification run triggers, its new head being "missing" from the checkpoint: one plain
    line instead, naming the keys by status."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = _ANSI.sub("", record.getMessage())
        if "LOAD REPORT" not in text:
            return True
        head, _, table = text.partition("\n")
        by_status: dict[str, list[str]] = {}
        for line in table.split("\nNotes:")[0].splitlines()[2:]:  # after the header and its rule
            cells = [c.strip() for c in line.split("|")]
            if len(cells) >= 2 and cells[0]:
                by_status.setdefault(cells[1].lower(), []).append(cells[0])
        model, _, source = head.partition(" LOAD REPORT from: ")
        keys = "; ".join(f"{status}: {', '.join(sorted(names))}" for status, names in by_status.items())
        newly = " (newly initialized)" if "missing" in by_status else ""
        record.msg, record.args = f"{model} from {source}: {keys}{newly}", ()
        return True


def quiet_library_noise() -> None:
    import warnings

    # The memory tracker's module hooks are global, and active during the one tracked step only,
    # which runs eagerly (force_eager): they fire once more for the compiled wrapper, a module that
    # holds no tensor of its own, so no byte or loss is counted twice (tests/memory/test_memory.py
    # pins the compiled run's step peak to the eager one's, byte for byte).
    warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
    # peft's get_peft_model reads transformers' deprecated alias itself: nothing a user can change
    warnings.filterwarnings(
        "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
    )
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_BitsandbytesKernels())
    logging.getLogger("transformers.modeling_utils").addFilter(_LoadReport())
