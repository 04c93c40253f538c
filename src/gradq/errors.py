"""Exceptions raised by gradq. All derive from :class:`GradqError`; the input-related ones are also
``ValueError`` so callers that catch ``ValueError`` keep working."""

from __future__ import annotations

__all__ = ["GradqError", "SpecError", "PayloadError", "NonFiniteError"]


class GradqError(Exception):
    """Base class of every error gradq raises on purpose."""


class SpecError(GradqError, ValueError):
    """A spec string or a quantizer parameter is invalid; the message lists the valid choices."""


class PayloadError(GradqError, ValueError):
    """A payload or byte stream cannot be decoded: wrong spec, wrong size, truncated or corrupt."""


class NonFiniteError(GradqError, ValueError):
    """The input holds NaN or Inf values; gradq never encodes them silently."""
