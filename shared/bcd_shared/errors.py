"""Errors by origin, converted once at each boundary.

A step either succeeds or raises one of these; the converge runner records the outcome:
- TerminalError: the spec asks for something this host can never do (bad settings, unknown
  device). Retrying without a new spec cannot help, so the section goes FAILED.
- RetryableError: the host misbehaved or is not ready yet (a tool failed, a file is busy). The
  section stays PROGRESSING and the next pass tries again.
- HelperRefused: the root helper refused or failed an action. Retryable: the agent cannot judge
  whether a later pass will be admitted, and the message starts with "helper: ".
"""

from __future__ import annotations


class StepError(Exception):
    """Base: a step that did not complete. `reason` is a short machine-readable code."""

    terminal: bool = False

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        return self.message


class TerminalError(StepError):
    """The desired state is impossible here; only a new spec can fix it."""

    terminal = True


class RetryableError(StepError):
    """The host or a tool failed; the next pass retries."""


class HelperRefused(RetryableError):
    """The root helper refused or failed the action (message prefixed "helper: ")."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(reason, message if message.startswith("helper: ") else f"helper: {message}")
