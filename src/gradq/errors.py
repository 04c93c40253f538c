"""Exceptions raised by gradq. All derive from :class:`GradqError`; the input-related ones are also
``ValueError`` so callers that catch ``ValueError`` keep working."""

from __future__ import annotations

__all__ = ["GradqError", "SpecError", "PayloadError", "NonFiniteError", "CommunicationError"]


class GradqError(Exception):
    """Base class of every error gradq raises on purpose."""


class SpecError(GradqError, ValueError):
    """A spec string or a quantizer parameter is invalid; the message lists the valid choices."""


class PayloadError(GradqError, ValueError):
    """A payload or byte stream cannot be decoded: wrong spec, wrong size, truncated or corrupt."""


class NonFiniteError(GradqError, ValueError):
    """The input holds NaN or Inf values; gradq never encodes them silently."""


class CommunicationError(GradqError, RuntimeError):
    """A collective did not complete: a peer died, stalled past the time limit or left the step.

    ``waiting_for`` names the operation (``"the all-to-all of the chunk payloads"``…), ``reason`` what
    went wrong in a few words, ``step`` the DDP hook's step when known, ``timeout`` the limit in seconds
    that applied, ``cause`` the backend's error.
    The process group cannot be trusted afterwards: end the process (every other rank fails too)."""

    def __init__(self, message: str, *, waiting_for: str = "", reason: str = "", step: "int | None" = None,
                 timeout: "float | None" = None, cause: "BaseException | None" = None) -> None:
        super().__init__(message)
        self.waiting_for = waiting_for
        self.reason = reason
        self.step = step
        self.timeout = timeout
        self.cause = cause

    def within(self, where: str, step: "int | None" = None) -> "CommunicationError":
        """The same failure, told from a caller's point of view (``where``: "gradq_hook: step 3"…)."""
        return CommunicationError(f"{where} failed waiting for {self.waiting_for}: {self.reason}",
                                  waiting_for=self.waiting_for, reason=self.reason, step=step,
                                  timeout=self.timeout, cause=self.cause)
