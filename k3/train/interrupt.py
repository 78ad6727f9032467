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
    """A context manager whose ``requested`` turns True at the first SIGINT (in the main thread only) once
    ``arm()`` was called, when the steps begin; before that (reading data, building the model) Ctrl-C interrupts
    at once, as there is no step to finish and nothing new to save."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested, self.armed, self._previous = False, False, None

    def arm(self) -> None:
        self.armed = True

    def _handle(self, signum, frame) -> None:
        signal.signal(signal.SIGINT, self._previous)  # the next Ctrl-C interrupts at once
        if not self.armed:
            raise KeyboardInterrupt
        self.requested = True
        print("\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again to stop now, keeping the previous "
              "one)", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopRequest":
        if self.enabled:
            previous = signal.signal(signal.SIGINT, self._handle)  # None: a handler set outside Python
            self._previous = previous if previous is not None else signal.default_int_handler
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            signal.signal(signal.SIGINT, self._previous)
