"""Lossless codecs: fixed-width bit fields and base-3 trits (``bitpack``), Elias omega/gamma codes
(``elias``), QSGD's sparse/dense Elias bitstreams (``qsgd_stream``) and rANS entropy coding (``ans``).

``elias``, ``qsgd_stream`` and ``ans`` load numba or constriction on first use, so import them from
their modules."""

from .bitpack import pack_bits, packed_nbytes, pack_trits, trit_nbytes, unpack_bits, unpack_trits

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes", "pack_trits", "unpack_trits", "trit_nbytes"]
