"""The gateway's engine clients: one `Backend` interface (`base.py`), one sibling per
engine (`sglang.py` for SGLang and the local engine, `vllm.py`, `router.py` for SGLang's
router), the HTTP plumbing they hold (`transport.py`), interruptible generation, the
neutral records they return (`records.py`), their errors, and the factory that is the
only gateway code reading the engine kind (`factory.py`)."""

from gateway.backends.base import Backend, SwapCheck
from gateway.backends.errors import BackendError, BackendUnavailable
from gateway.backends.records import Generation, GenerationDelta, SwapTimings, TokenRequest
from gateway.backends.router import RouterClient
from gateway.backends.sglang import SGLangClient
from gateway.backends.vllm import VLLMClient

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "Generation",
    "GenerationDelta",
    "RouterClient",
    "SGLangClient",
    "SwapCheck",
    "SwapTimings",
    "TokenRequest",
    "VLLMClient",
]
