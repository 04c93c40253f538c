"""Every quantization scheme, one family per module; importing this package registers them all."""

from .base import EncodeContext, Quantizer, SharedStat
from .summable import SummableQuantizer
from . import cast, qsgd, maxnorm, multiscale, terngrad, orq, binary, sparse  # noqa: F401  (registration)

__all__ = ["Quantizer", "SummableQuantizer", "SharedStat", "EncodeContext"]
