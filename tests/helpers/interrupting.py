"""A classification task that sends its own process SIGTERM from inside a weakref callback, at the
``call``-th call of one of its hooks (``during``): Python drops what a signal handler raises there
("Exception ignored in: <finalize object ...>"), as it does in any destructor."""

from __future__ import annotations

import os
import signal
import weakref

from effitrain.train.tasks import Classification


class SigtermInACallback(Classification):
    def __init__(self, during: str = "loss_sum", call: int = 1):
        super().__init__()
        self.during, self.call, self.calls = during, call, 0

    def _maybe_signal(self, hook: str) -> None:
        if hook != self.during:
            return
        self.calls += 1
        if self.calls == self.call:
            dropped = type("Dropped", (), {})()
            weakref.finalize(dropped, os.kill, os.getpid(), signal.SIGTERM)
            del dropped  # the callback runs here, and the handler inside it

    def loss_sum(self, model, batch):
        self._maybe_signal("loss_sum")
        return super().loss_sum(model, batch)

    def evaluate(self, model, dataloader, accelerator) -> dict:
        self._maybe_signal("evaluate")
        return super().evaluate(model, dataloader, accelerator)
