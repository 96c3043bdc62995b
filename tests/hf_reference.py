"""Greedy reference tokens from HF transformers, one prompt at a time (no padding)."""

from __future__ import annotations

import torch
from bf16_checks import GreedyRun, top_k_logprobs
from transformers import AutoModelForCausalLM

# The engine dtype of every test that asserts exact parity with HF's fp32 model
# (same greedy tokens, logprobs to 1e-4). It must be named: dtype="auto" is
# bfloat16 on a CPU with bf16 dot products (nanoengine/platforms/cpu.py), where
# only closeness holds (tests/bf16_checks.py, tests/test_bf16_engine.py).
EXACT_DTYPE = "float32"


class HFGreedy:
    """Runs HF's own model code on the same weights, with its own KV cache, in ``dtype``
    (fp32 unless asked: the weights are cast as they load, as the engine casts them)."""

    def __init__(self, model_path: str, dtype: torch.dtype = torch.float32, **config_overrides: object) -> None:
        # config_overrides replace config.json values (e.g. sliding_window=None: full attention).
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **config_overrides)
        self.model.eval()

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], num_tokens: int) -> list[int]:
        """argmax decoding for exactly num_tokens (EOS neither stops nor is suppressed)."""
        return self.generate_with_logprobs(prompt_ids, num_tokens, 0).token_ids

    @torch.inference_mode()
    def generate_with_logprobs(self, prompt_ids: list[int], num_tokens: int, k: int) -> GreedyRun:
        """Like ``generate``, with each position's top-k logprobs (log_softmax of the logits
        widened to fp32, as nanoengine computes its logprobs)."""
        input_ids = torch.tensor([prompt_ids])
        out = self.model(input_ids=input_ids, use_cache=True)
        run = GreedyRun([], [])
        for _ in range(num_tokens):
            logits = out.logits[0, -1]
            next_id = int(logits.argmax())
            run.token_ids.append(next_id)
            run.logprobs.append(top_k_logprobs(logits, k) if k else {})
            out = self.model(
                input_ids=torch.tensor([[next_id]]), past_key_values=out.past_key_values, use_cache=True
            )
        return run
