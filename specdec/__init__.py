"""specdec: exact speculative decoding (draft/target and prompt lookup) with per-tenant K.

The core package imports neither Ray nor gRPC.
"""

__version__ = "0.1.0"

import logging as _logging

# transformers imports torchao (when installed) on import; torchao then logs, at WARNING, every
# CUDA-only extension it cannot load on a CPU-only torch ("Failed to load ..._C_mxfp8..."). Those
# are irrelevant to the CPU kernels used here (torch's own), and torch's pytree warns that two of
# torchao's enums need no registration any more: keep both out of every log.
_logging.getLogger("torchao").setLevel(_logging.ERROR)
_logging.getLogger("torch.utils._pytree").setLevel(_logging.ERROR)
