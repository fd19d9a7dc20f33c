"""splitserve.client: typed Python client (sync and asyncio) over the coordinator's gRPC stubs.

``Client`` (blocking) and ``AsyncClient`` (asyncio) offer ``stream`` / ``generate`` / ``abort``
/ ``model_info`` / ``wait_ready`` with deadlines, safe retries and cancellation; every failure
is a ``ClientError``. ``generate`` takes OpenAI's function ``tools`` (``client/tools.py``), and
``AsyncClient.generate_choices`` forks one prompt into ``n`` choices (``client/choices.py``);
``AsyncClient.beam_search`` searches ``n`` beams (``client/beam_search.py``).
Torch-free: a client machine needs no torch (nor a GPU).
"""

from splitserve.client.async_client import AsyncClient
from splitserve.client.beam_search import Beam, BeamResult, BeamSearchParams
from splitserve.client.errors import ClientError, RetryPolicy
from splitserve.client.sync_client import Client
from splitserve.client.types import (
    ChatMessage,
    ChatTemplate,
    Chunk,
    Finish,
    Generation,
    LatencyTargets,
    LoadedAdapter,
    ModelInfo,
    PromptToken,
    Sampling,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)
from splitserve.common.grammar import GrammarSpec

__all__ = [
    "AsyncClient",
    "Beam",
    "BeamResult",
    "BeamSearchParams",
    "ChatMessage",
    "ChatTemplate",
    "Chunk",
    "Client",
    "ClientError",
    "Finish",
    "Generation",
    "GrammarSpec",
    "LatencyTargets",
    "LoadedAdapter",
    "ModelInfo",
    "PromptToken",
    "RetryPolicy",
    "Sampling",
    "TokenLogprob",
    "ToolCall",
    "TopLogprob",
    "Usage",
]
