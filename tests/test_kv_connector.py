"""The KV connector in miniature (chapter 5): prefill on one engine, decode on another.

The producer saves each prefilled prompt's full KV blocks to a directory keyed
by block hash; the consumer finds them, loads them on a thread while its
request waits in WAITING_FOR_REMOTE_KVS, and decodes exactly the greedy tokens
it would have produced by computing the prefill itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import add, make_engine, path, prompt_ids, run
from safetensors.torch import load_file, save_file

from nanoengine.config import KVTransferConfig
from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.request import RequestStatus
from nanoengine.sampling_params import SamplingParams

S = RequestStatus
PROMPT = prompt_ids(70)  # 4 full blocks of 16 and 6 tokens more
PARAMS = SamplingParams(temperature=0.0, max_tokens=10)


def _storage(storage: Path, role: str) -> KVTransferConfig:
    return KVTransferConfig("SharedStorageConnector", role,  # type: ignore[arg-type]
                            {"shared_storage_path": str(storage)})


def _produce(model: str, storage: Path) -> None:
    producer = make_engine(model, kv_transfer_config=_storage(storage, "kv_producer"))
    add(producer, "prefill", PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    run(producer)
    producer.shutdown()


def _consume(model: str, storage: Path) -> tuple[list[int], list[RequestStatus], int]:
    consumer = make_engine(model, kv_transfer_config=_storage(storage, "kv_consumer"))
    request = add(consumer, "r", PROMPT, PARAMS)
    output = run(consumer)["r"]
    consumer.shutdown()
    return output.outputs[0].token_ids, path(request), output.num_external_computed_tokens


@pytest.fixture(scope="module")
def baseline(tiny_llama: str) -> list[int]:
    engine = make_engine(tiny_llama)
    add(engine, "r", PROMPT, PARAMS)
    return run(engine)["r"].outputs[0].token_ids


def test_consumer_loads_the_prefix_and_decodes_the_same_tokens(
    tiny_llama: str, tmp_path: Path, baseline: list[int]
) -> None:
    _produce(tiny_llama, tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) == len(PROMPT) // 16
    tokens, history, skipped = _consume(tiny_llama, tmp_path)
    assert history == [S.WAITING, S.WAITING_FOR_REMOTE_KVS, S.WAITING, S.RUNNING, S.FINISHED_LENGTH_CAPPED]
    assert skipped == 64  # 4 whole blocks; the last 6 prompt tokens are computed here
    assert tokens == baseline


def test_the_loaded_kv_is_really_used(tiny_llama: str, tmp_path: Path, baseline: list[int]) -> None:
    """Negative control: zero the stored K/V and the consumer's answer changes."""
    _produce(tiny_llama, tmp_path)
    for block_file in tmp_path.glob("*.safetensors"):
        kv = load_file(block_file)["kv"]
        save_file({"kv": torch.zeros_like(kv)}, str(block_file))
    tokens, history, skipped = _consume(tiny_llama, tmp_path)
    assert S.WAITING_FOR_REMOTE_KVS in history and skipped == 64
    assert tokens != baseline


def test_nothing_stored_means_no_remote_wait(tiny_llama: str, tmp_path: Path, baseline: list[int]) -> None:
    tokens, history, skipped = _consume(tiny_llama, tmp_path)
    assert history == [S.WAITING, S.RUNNING, S.FINISHED_LENGTH_CAPPED]
    assert skipped == 0 and tokens == baseline


def test_kv_transfer_config_is_validated(tiny_llama: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_role"):
        _storage(tmp_path, "kv_sender")
    with pytest.raises(ValueError, match="shared_storage_path"):
        KVTransferConfig("SharedStorageConnector", kv_connector_extra_config={"shared_storage_path": ""})
    args = EngineArgs(
        model=tiny_llama, enable_prefix_caching=False, kv_transfer_config=_storage(tmp_path, "kv_both")
    )
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        args.create_engine_config()


def test_abort_while_loading_leaves_the_engine_consistent(
    tiny_llama: str, tmp_path: Path, baseline: list[int]
) -> None:
    _produce(tiny_llama, tmp_path)
    consumer = make_engine(tiny_llama, kv_transfer_config=_storage(tmp_path, "kv_consumer"))
    first = add(consumer, "first", PROMPT, PARAMS)
    consumer.step()  # allocates blocks and starts the load
    assert first.status == S.WAITING_FOR_REMOTE_KVS
    consumer.abort_request("first")
    second = add(consumer, "second", PROMPT, PARAMS)
    output = run(consumer)["second"]
    assert path(first)[-1] == S.FINISHED_ABORTED
    assert S.WAITING_FOR_REMOTE_KVS in path(second) and output.outputs[0].token_ids == baseline
