"""Greedy reference tokens from HF transformers, one prompt at a time (no padding)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


class HFGreedy:
    """Runs HF's own model code on the same weights, with its own KV cache."""

    def __init__(self, model_path: str) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.eval()

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], num_tokens: int) -> list[int]:
        """argmax decoding for exactly num_tokens (EOS neither stops nor is suppressed)."""
        input_ids = torch.tensor([prompt_ids])
        out = self.model(input_ids=input_ids, use_cache=True)
        generated: list[int] = []
        for _ in range(num_tokens):
            next_id = int(out.logits[0, -1].argmax())
            generated.append(next_id)
            out = self.model(
                input_ids=torch.tensor([[next_id]]), past_key_values=out.past_key_values, use_cache=True
            )
        return generated
