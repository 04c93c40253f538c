"""Units of the performance model: its error type, rates and sizes.

Internally every bandwidth is in **bytes per second**, every latency in **seconds**, every size in
**bytes**; the public results are in milliseconds. ``MB`` is the decimal megabyte (10⁶ bytes), as in
"a 100 MB gradient" and "125 MB/s = 1 Gbit/s".
"""

from __future__ import annotations

import math
import re

from ..errors import GradqError

__all__ = ["PerfModelError", "MB", "parse_rate", "format_rate", "check_nonneg", "check_pos"]

#: one (decimal) megabyte in bytes
MB = 1_000_000

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
           "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
# number, optional SI/binary prefix, unit. Case matters only in the unit's b/B (bit/byte).
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)\s*([kKmMgGtT]i?)?\s*"
                      r"(bits/s|bit/s|bits|bit|b/s|B/s|bytes/s|byte/s|bps|Bps|BPS)\s*$")
_BIT_UNITS = {"bits/s", "bit/s", "bits", "bit", "b/s"}
_EXAMPLES = "'1gbit', '10gbit', '100mbit', '25Gbit/s' (bits/s) or '125MB/s', '1.25GB/s' (bytes/s)"


class PerfModelError(GradqError, ValueError):
    """An input of the performance model is invalid; the message says which and how to fix it."""


def parse_rate(rate: str | int | float) -> float:
    """Bytes per second from a rate: ``"1gbit"`` → 1.25e8, ``"125MB/s"`` → 1.25e8, ``"10Gbit/s"`` → 1.25e9.

    Accepted units: ``bit``, ``bits``, ``bit/s``, ``b/s`` (bits per second) and ``B/s``, ``byte/s``,
    ``bytes/s`` (bytes per second), with an optional decimal (``k M G T``, case-insensitive) or binary
    (``Ki Mi Gi Ti``) prefix. ``bps`` is refused: ``tc`` (and :func:`gradq.netem.parse_rate`) reads it as
    BYTES per second while papers write "1 Gbps" for bits, so either reading would silently be off by 8×
    for someone. A bare number (int or float, not a string) is taken as bytes per second.

    Raises:
        PerfModelError: unreadable, non-positive or non-finite rate.
    """
    if isinstance(rate, bool):
        raise PerfModelError(f"rate must be a string such as {_EXAMPLES}, got {rate!r}")
    if isinstance(rate, (int, float)):
        value = float(rate)
    else:
        text = str(rate)
        m = _RATE_RE.match(text)
        if not m:
            raise PerfModelError(f"cannot read rate {text!r}; write e.g. {_EXAMPLES}")
        unit = m.group(3)
        if unit.lower() == "bps":
            raise PerfModelError(f"rate {text!r} is ambiguous: 'bps' means bytes/s to tc but bits/s in papers; "
                                 f"write e.g. {_EXAMPLES}")
        value = float(m.group(1)) * _PREFIX[(m.group(2) or "").lower()]
        if unit in _BIT_UNITS:
            value /= 8.0
    if not (value > 0 and math.isfinite(value)):
        raise PerfModelError(f"rate must be positive and finite, got {rate!r}")
    return value


def format_rate(bytes_per_s: float) -> str:
    """A rate for people, in bits per second: 1.25e8 → ``"1 Gbit/s"``, 1.25e10 → ``"100 Gbit/s"``,
    1e10 → ``"80 Gbit/s"``."""
    bits = 8.0 * float(bytes_per_s)
    for unit, f in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= f:
            return f"{bits / f:.4g} {unit}"
    return f"{bits:.4g} bit/s"


def check_nonneg(name: str, value: float) -> float:
    """``value`` as a float if it is a finite number ≥ 0, else a :class:`PerfModelError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise PerfModelError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_pos(name: str, value: float) -> float:
    """``value`` as a float if it is a finite number > 0, else a :class:`PerfModelError` naming ``name``."""
    if check_nonneg(name, value) == 0:
        raise PerfModelError(f"{name} must be > 0, got {value!r}")
    return float(value)
