"""Chapter 10's walkthrough on the tiny model: both engines' moments, the pull, the prefix hits, the expiry."""

from __future__ import annotations

import os

from process_helpers import pid_gone

from chapters import ch10_disaggregated


def _whats(rows: list[ch10_disaggregated.JournalRow]) -> list[str]:
    return [what for _, _, _, what, _ in rows]


def test_walkthrough_shows_one_request_on_both_engines(tiny_llama: str) -> None:
    result = ch10_disaggregated.main(["--model", tiny_llama, "--max-model-len", "512", "--max-tokens", "8",
                                      "--hold-timeout-s", "1"])
    assert os.getpid() not in result.core_pids
    assert result.proxied_tokens == result.colocated_tokens and len(result.proxied_tokens) == 8
    producer, consumer = _whats(result.producer_journal), _whats(result.consumer_journal)
    # The producer prefills, holds its blocks, and frees them once they were read ...
    assert any("do_remote_decode" in what for what in producer)
    assert any("delay_free_blocks=True" in what for what in producer)
    read = next(row for row in result.producer_journal if row[3].startswith("worker: blocks read"))
    held = next(row for row in result.producer_journal if "delay_free_blocks=True" in row[3])
    assert held[4] > 0 and read[4] == 0, "the producer's blocks are in use while held, free once read"
    # ... the consumer waits for them, then computes the last prompt token and decodes.
    assert any("WAITING_FOR_REMOTE_KVS" in what for what in consumer)
    loaded = next(i for i, what in enumerate(consumer) if what.startswith("worker: KV loaded"))
    assert consumer[loaded + 1].startswith("scheduled 1 prompt token(s)")
    assert result.producer_journal[-1][0] > result.producer_journal[0][0]
    # Every block the producer held crossed the network; the follow-up found some at home.
    assert result.blocks_pulled_first > 0 and result.bytes_moved > 0
    assert result.prefix_hit_tokens_follow_up > 0 and result.prefix_hit_tokens_follow_up % ch10_disaggregated.BLOCK_SIZE == 0
    assert result.held_then_expired
    # Both engine-core processes ended with the walkthrough.
    assert all(pid_gone(pid, 10.0) for pid in result.core_pids)
