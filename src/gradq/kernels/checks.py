"""Deferred checks of decoded payloads: refuse a corrupt payload later, without a host read per decode.

A decode refuses a payload whose fields no encode writes (a TernGrad field of 3, a trit byte above
242, a level or scale index past the last): every backend counts them while it decodes and raises
:class:`gradq.PayloadError`. On a GPU reading that count is a host read, which waits for the decode
(a synchronization per call). Inside :func:`deferred_checks` the decodes instead add, on the device,
one to a counter for each payload in which they found such fields, and return: their output is then
not meaningful where the fields were invalid (every kernel reads in bounds: an invalid index reads
the first level or scale), and the caller must refuse it after one look at the counter.

The protocols of :mod:`gradq.comm` decode this way. Called alone, one refuses such a payload after
its last collective, so that no peer waits in a collective for a rank that left. Under the DDP hook
(and ``allreduce_``) the counter rides in the step's agreement with the damaged payloads, so every
rank refuses (or skips) the same step, with one host read per step. A decode outside the context
raises at once, as before.

    with deferred_checks() as checks:
        a = q.decode(p1)
        b = q.decode(p2)
    checks.check()          # one host read; PayloadError if p1 or p2 held invalid fields
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Union

import torch

from ..errors import PayloadError

__all__ = ["DeferredChecks", "deferred_checks", "refuse_invalid"]


class DeferredChecks:
    """The payloads found corrupt by the decodes run inside :func:`deferred_checks`: a count that stays
    where the decodes ran (a device tensor, or an int for decodes that counted on the host)."""

    def __init__(self) -> None:
        self._host = 0
        self._device: Optional[torch.Tensor] = None
        self.kinds: list[str] = []   # what was checked (not what failed: that would need a host read)

    def add(self, bad: Union[torch.Tensor, int], what: str) -> None:
        """One decode's count of invalid fields (a tensor of per-program counts, or an int)."""
        if what not in self.kinds:
            self.kinds.append(what)
        if isinstance(bad, torch.Tensor):
            hit = bad.sum(dtype=torch.int64).clamp_(max=1)   # (two small operations, no host read)
            self._device = hit if self._device is None else self._device + hit
        else:
            self._host += int(bad > 0)

    @property
    def count(self) -> Union[torch.Tensor, int]:
        """The number of corrupt payloads: an int, or a 0-dim int64 tensor on the decodes' device."""
        return self._host if self._device is None else self._device + self._host

    def check(self) -> None:
        """Raise :class:`gradq.PayloadError` if any decode found invalid fields (one host read)."""
        n = int(self.count)
        if n:
            raise PayloadError(f"{n} payload(s) held codes no encode writes ({'; '.join(self.kinds)}); "
                               "their decodes are not meaningful")


_ACTIVE: contextvars.ContextVar[Optional[DeferredChecks]] = contextvars.ContextVar("gradq_deferred_checks",
                                                                                   default=None)


@contextmanager
def deferred_checks() -> Iterator[DeferredChecks]:
    """Decodes inside count corrupt payloads in the yielded :class:`DeferredChecks` instead of raising
    (this thread and context only; an inner context takes the counts of the decodes inside it)."""
    checks = DeferredChecks()
    token = _ACTIVE.set(checks)
    try:
        yield checks
    finally:
        _ACTIVE.reset(token)


def refuse_invalid(bad: Union[torch.Tensor, int], message: Callable[[int], str], what: str) -> bool:
    """A decode's check: ``bad`` counts its invalid fields (per program, on its device, or an int).
    Inside :func:`deferred_checks` it is added there and the result is True: the caller goes on, and
    must keep every read and write in bounds whatever the fields hold. Otherwise a nonzero count
    raises :class:`gradq.PayloadError` with ``message(count)`` (a host read where ``bad`` is on a
    GPU), and the result is False."""
    checks = _ACTIVE.get()
    if checks is not None:
        checks.add(bad, what)
        return True
    n = int(bad.sum()) if isinstance(bad, torch.Tensor) else int(bad)
    if n:
        raise PayloadError(message(n))
    return False
