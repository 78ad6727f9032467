"""Ctrl-C during training: the first one stops the run after the current step, with a checkpoint; a second one
interrupts at once (the checkpoint writer is atomic, so the previous checkpoint survives it).

A half-done step (gradients accumulated, the optimiser part-way through its parameters) cannot be saved, so the
request waits for the step boundary, where a checkpoint is the same as a ``--save-every`` one and resuming from
it continues the run exactly. Only one-process runs install the handler: under torchrun the ranks would see the
signal at different steps and disagree about which step to save.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path


class TrainingInterrupted(KeyboardInterrupt):
    """Raised by ``train`` after it saved the checkpoint of ``step`` in ``checkpoint`` on a Ctrl-C."""

    def __init__(self, step: int, checkpoint: Path):
        super().__init__(f"interrupted at step {step}; checkpoint in {checkpoint}")
        self.step, self.checkpoint = step, Path(checkpoint)


class StopRequest:
    """A context manager whose ``requested`` turns True at the first SIGINT (in the main thread only)."""

    def __init__(self, enabled: bool = True, stream=sys.stderr):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested, self.stream, self._previous = False, stream, None

    def _handle(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)  # the next Ctrl-C interrupts at once
        self.stream.write("\nk3 train: Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again to stop "
                          "now without one)\n")
        self.stream.flush()

    def __enter__(self) -> "StopRequest":
        if self.enabled:
            previous = signal.signal(signal.SIGINT, self._handle)
            self._previous = previous if previous is not None else signal.default_int_handler  # None: set outside Python
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            signal.signal(signal.SIGINT, self._previous)
