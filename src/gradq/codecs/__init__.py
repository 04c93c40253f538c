"""Lossless codecs: fixed-width bit fields and base-3 trits (``bitpack``)."""

from .bitpack import pack_bits, packed_nbytes, pack_trits, trit_nbytes, unpack_bits, unpack_trits

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes", "pack_trits", "unpack_trits", "trit_nbytes"]
