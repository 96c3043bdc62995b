"""EngineCoreClient: the adapter between LLMEngine and EngineCore.

Chapter 5 (engine skeleton) explains why this seemingly empty layer exists: in one
process the client calls the core directly; in a server (chapter 8) the core runs
in its own process and the client ships the same messages over a socket -- and
``LLMEngine`` does not change. vLLM 0.32 counterpart:
``vllm/v1/engine/core_client.py`` (``EngineCoreClient``, ``InprocClient``,
``SyncMPClient``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from nanoengine.config import EngineConfig
from nanoengine.engine import EngineCoreOutputs, EngineCoreRequest
from nanoengine.engine.core import EngineCore
from nanoengine.trace import EngineTrace
from nanoengine.utils.component_tree import TreeNode


class EngineCoreClient(ABC):
    """The interface every transport implements; LLMEngine sees only this."""

    @staticmethod
    def make_client(engine_config: EngineConfig, multiprocess_mode: bool = False) -> EngineCoreClient:
        """Pick a transport. Only the in-process one exists so far (chapter 8 adds
        the multi-process client behind this same interface).
        """
        if multiprocess_mode:
            raise ValueError("multiprocess_mode=True is not available yet; use the in-process client.")
        return InprocClient(engine_config)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """Advance the engine and return what it produced."""

    @abstractmethod
    def abort_requests(self, request_ids: Iterable[str]) -> None: ...

    @abstractmethod
    def append_prompt(self, request_id: str, token_ids: list[int], final: bool) -> None:
        """Streaming input: more prompt for a request added with ``streaming_input``."""

    @abstractmethod
    def shutdown(self) -> None: ...

    @abstractmethod
    def get_trace(self) -> EngineTrace | None:
        """The engine core's step trace (chapters 3-4); None when tracing is off."""

    def get_engine_core(self) -> EngineCore:
        """The live ``EngineCore`` behind this client, for code that inspects it.

        Chapter 5 puts this client between ``LLMEngine`` and ``EngineCore`` so the
        engine never learns where the core runs. Driving the engine needs only the
        messages above (``add_request``, ``get_output``, ...), which any transport
        can carry. Reading the core's state -- its scheduler, its KV cache manager,
        the memory report of chapter 6 -- needs the object itself, and only a
        client in the same process has one to give: ``InprocClient``, the client
        ``LLM(...)`` builds by default, holds it as ``self.engine_core``, just as
        vLLM 0.32's ``InprocClient`` does (``vllm/v1/engine/core_client.py``).

        The base class therefore raises ``RuntimeError``. Asking is not a wrong
        argument type (``TypeError``) nor an unfinished method
        (``NotImplementedError``): every client is a valid ``EngineCoreClient``,
        and a client whose core runs in another process -- the multi-process
        client chapter 8 adds -- can never hand out that object; whether one
        exists depends on how the engine was started, which is known only at run
        time. Chapters and tests that inspect the core call this instead of
        reaching through ``.engine_core``, so the type checker knows what they get
        and they fail with this message, not an ``AttributeError``, on such a
        client.
        """
        raise RuntimeError(
            f"{type(self).__name__} does not hold the EngineCore: with this client it "
            "lives in another process, so there is no live object to hand out. Only "
            "the in-process client (InprocClient, the default of LLM(...)) can give it."
        )


class InprocClient(EngineCoreClient, TreeNode):
    """In-process: each ``get_output`` is one direct ``EngineCore.step()``
    (``step_with_batch_queue()`` with async scheduling).

    The client, not LLMEngine, holds the EngineCore, so printing the client
    shows the subtree that chapter 5 of the study notes draws below
    ``engine_core``.
    """

    tree_children = ("engine_core",)

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_core = EngineCore(engine_config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def get_output(self) -> EngineCoreOutputs:
        outputs, _ = self.engine_core.step_fn()
        return outputs

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def append_prompt(self, request_id: str, token_ids: list[int], final: bool) -> None:
        self.engine_core.append_prompt(request_id, token_ids, final)

    def shutdown(self) -> None:
        self.engine_core.shutdown()

    def get_trace(self) -> EngineTrace | None:
        # Same process: the live object itself, still growing as steps run.
        return self.engine_core.trace

    def get_engine_core(self) -> EngineCore:
        """The ``EngineCore`` this client drives: same process, the object itself."""
        return self.engine_core
