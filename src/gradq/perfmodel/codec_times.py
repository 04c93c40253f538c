"""Measured codec speeds for the performance model: the JSON that ``benchmarks/bench_codecs.py --memory
--json FILE`` writes, read back as milliseconds per MB of fp32 gradient for each spec.

A projection's codec time is then ``encode_ms_per_mb · (4n / 10⁶)`` (and the same for decode), scaled
from the benchmark's vector to the model's gradient: the kernels are memory-bound and linear in ``n``
once ``n`` is far above a bucket (the benchmark uses 25M values).

``gradq perfmodel`` uses the file shipped with the package (:data:`DEFAULT_CODEC_TIMES`, measured on a
2-core CPU with the numba kernels, see ``docs/performance.md``) unless ``--codec-times FILE`` names
another — measure your own device with ``bench_codecs.py --memory --device cuda --json FILE`` — or
``--codec-times none`` asks for no codec time; ``--codec-times h100`` and ``--codec-times h200`` use
the shipped H100 and H200 measurements (Triton kernels, 2026-11-27 and 2026-11-29). The shipped CPU figures overstate a GPU's codec time, so
a projection with them is conservative for compression.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from .units import PerfModelError

__all__ = ["CodecTimes", "load_codec_times", "DEFAULT_CODEC_TIMES", "H100_CODEC_TIMES", "H200_CODEC_TIMES",
           "codec_times_from"]

#: the measurement shipped with gradq (CPU, numba kernels); see the module docstring
DEFAULT_CODEC_TIMES = Path(__file__).with_name("codec_times_cpu.json")
#: the same benchmark on an NVIDIA H100 (Triton kernels), shipped too: ``--codec-times h100``
H100_CODEC_TIMES = Path(__file__).with_name("codec_times_h100.json")
#: and on an NVIDIA H200 (Triton kernels, 2026-11-29): ``--codec-times h200``
H200_CODEC_TIMES = Path(__file__).with_name("codec_times_h200.json")
_FORMAT = "gradq-codec-times/1"


@dataclass(frozen=True)
class CodecTimes:
    """Measured encode / decode speed per canonical spec, in ms per MB (10⁶ bytes) of fp32 input.

    Args:
        per_mb: canonical spec (``gradq.build(s).spec``) → ``(encode_ms_per_mb, decode_ms_per_mb)``.
        device_name: what the times were measured on (e.g. ``"NVIDIA H100"`` or ``"CPU, 2 threads"``).
        source: where they came from (a path), for messages and reports.
    """

    per_mb: dict[str, tuple[float, float]]
    device_name: str = "unknown"
    source: str = ""
    meta: dict = field(default_factory=dict, compare=False)

    def lookup(self, spec: str) -> Optional[tuple[float, float]]:
        """``(encode_ms_per_mb, decode_ms_per_mb)`` of ``spec`` (any spelling gradq accepts), or ``None``
        when the file has no measurement of it."""
        return self.per_mb.get(_canonical(spec))

    def describe(self) -> str:
        """One line: where the times come from."""
        return f"codec times measured on {self.device_name} ({self.source})"


def _canonical(spec: str) -> str:
    from ..factory import build

    try:
        return build(spec).spec
    except ValueError:
        return spec.strip()


#: parsed files by (path, modification time, size): a sweep asks for the same file once per prediction
_LOADED: dict[tuple[str, int, int], CodecTimes] = {}


def load_codec_times(path: Union[str, Path]) -> CodecTimes:
    """Read a ``bench_codecs.py --memory --json`` file (parsed once while it is unchanged).

    Raises:
        PerfModelError: the file is missing, not JSON, or not in that format (the message says which).
    """
    p = Path(path)
    try:
        st = p.stat()
        key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
        if key in _LOADED:
            return _LOADED[key]
        doc = json.loads(p.read_text())
    except OSError as e:
        raise PerfModelError(f"cannot read codec times {str(p)!r}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise PerfModelError(f"codec times {str(p)!r} is not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise PerfModelError(f"{str(p)!r} is not a codec-times file (format {_FORMAT!r}); write one with "
                             "python benchmarks/bench_codecs.py --memory --json FILE")
    try:
        mb = float(doc["input_mb"])
        per_mb = {}
        for row in doc["rows"]:
            # the hook encodes what it screened itself (check_finite=False) and its protocols decode with
            # their checks deferred (kernels.deferred_checks): those times where measured
            e = float(row.get("encode_unchecked_ms", row["encode_ms"]))
            d = float(row.get("decode_deferred_ms", row["decode_ms"]))
            if not (mb > 0 and e >= 0 and d >= 0):
                raise ValueError
            per_mb[_canonical(str(row["spec"]))] = (e / mb, d / mb)
    except (KeyError, TypeError, ValueError):
        raise PerfModelError(f"codec times {str(p)!r}: every row needs a spec and non-negative encode_ms, "
                             "decode_ms; the file needs input_mb > 0") from None
    times = CodecTimes(per_mb, str(doc.get("device_name", doc.get("device", "unknown"))), str(p),
                       {k: v for k, v in doc.items() if k != "rows"})
    _LOADED[key] = times
    return times


def codec_times_from(value: Union[None, str, Path, CodecTimes]) -> Optional[CodecTimes]:
    """A :class:`CodecTimes` from ``None``/``"none"`` (no codec time), ``"default"`` (the shipped CPU
    file), ``"h100"`` or ``"h200"`` (the shipped GPU files), a path, or a :class:`CodecTimes` as it is."""
    if value is None or isinstance(value, CodecTimes):
        return value
    text = str(value).strip()
    if text.lower() == "none":
        return None
    shipped = {"default": DEFAULT_CODEC_TIMES, "h100": H100_CODEC_TIMES, "h200": H200_CODEC_TIMES}
    return load_codec_times(shipped.get(text.lower(), text))
