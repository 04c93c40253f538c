"""gradq — gradient quantization for data-parallel PyTorch.

Build any scheme from a spec string and move its bytes::

    import gradq
    q = gradq.build("qsgd:bits=4,bucket=512")
    payload = q.encode(grad, seed=0)      # packed bytes + scales; payload.nbytes is what crosses the wire
    approx = q.decode(payload)            # same shape, dtype and device as grad

``gradq.available()`` lists every scheme; ``docs/algorithms.md`` states their math and wire sizes.
"""

from .comm import lifecycle as _lifecycle

if _lifecycle._launched_worker():  # under torchrun & co.: before the script creates its process group
    _lifecycle.before_init()

from .errors import CommunicationError, GradqError, NonFiniteError, PayloadError, SpecError
from .payload import Payload
from .quantizers import Quantizer, SharedStat, SummableQuantizer
from .factory import available, build, registry
from .transforms import ErrorFeedback
from .ddp import GradqState, register
from .comm import allreduce_
from .comm.lifecycle import teardown

__version__ = "0.1.0"

__all__ = [
    "build", "available", "registry", "Quantizer", "SummableQuantizer", "SharedStat", "Payload",
    "ErrorFeedback", "GradqState", "register", "allreduce_", "teardown", "GradqError", "SpecError", "PayloadError", "NonFiniteError",
    "CommunicationError",
    "__version__",
]
