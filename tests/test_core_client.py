"""EngineCoreClient.get_engine_core: the one typed way from the client to the live EngineCore."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from engine_helpers import make_engine

from nanoengine.engine import EngineCoreOutputs, EngineCoreRequest
from nanoengine.engine.core import EngineCore
from nanoengine.engine.core_client import EngineCoreClient, InprocClient


def test_inproc_client_hands_out_its_engine_core(tiny_llama: str) -> None:
    engine = make_engine(tiny_llama)
    client = engine.engine_core
    assert isinstance(client, InprocClient)  # LLMEngine's default transport
    core = client.get_engine_core()
    assert isinstance(core, EngineCore)
    assert core is client.engine_core  # the live object, not a copy
    engine.shutdown()


class _OutOfProcessClient(EngineCoreClient):
    """Stands for chapter 8's multi-process client: it ships messages and holds no core."""

    def add_request(self, request: EngineCoreRequest) -> None:
        pass

    def get_output(self) -> EngineCoreOutputs:
        return EngineCoreOutputs()

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        pass

    def append_prompt(self, request_id: str, token_ids: list[int], final: bool) -> None:
        pass

    def shutdown(self) -> None:
        pass


def test_client_without_the_core_refuses_and_says_why() -> None:
    with pytest.raises(RuntimeError) as raised:
        _OutOfProcessClient().get_engine_core()
    message = str(raised.value)
    assert "_OutOfProcessClient does not hold the EngineCore" in message
    assert "another process" in message and "InprocClient" in message
