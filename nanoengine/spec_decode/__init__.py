"""Speculative decoding (chapter 9): draft several tokens cheaply, verify them in one forward pass.

A proposer guesses the next ``k`` tokens of a request; the target model then
scores the request's last token and all ``k`` guesses in one step (``k + 1``
positions instead of one), and the rejection sampler keeps the longest run of
guesses the target agrees with, plus one token of the target's own. With
greedy sampling the output is exactly what the target alone would write;
with temperature it has exactly the target's distribution.

vLLM 0.32 counterpart: ``vllm/v1/spec_decode/`` (the proposers and
``SpecDecodingStats``) and ``vllm/v1/sample/rejection_sampler.py``.
"""
