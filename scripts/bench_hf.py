"""HF ``generate`` as a benchmarked system: static, left-padded batches (chapter 2).

Split out of scripts/bench.py, which compares it with nanoengine (and vLLM-CPU):
a static batch runs until its longest request is done, which is exactly what
continuous batching avoids. vLLM 0.32 counterpart: the ``hf`` backend of
``vllm/benchmarks/throughput.py``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from bench_child import check_lengths
from transformers import AutoModelForCausalLM


class WorkloadLike(Protocol):
    """What a system reads of bench.py's ``Workload``."""

    name: str
    prompts: list[list[int]]
    max_tokens: list[int]


class HFSystem:
    """HF ``generate`` on left-padded static batches of ``batch_size`` requests."""

    name = "HF generate"

    def __init__(self, model_path: str, batch_size: int, dtype: str = "float32") -> None:
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype), local_files_only=True
        )
        self.model.eval()
        pad_id = self.model.generation_config.pad_token_id
        # Which id fills the padding does not matter (the attention mask hides it),
        # but generate() warns without one.
        self.pad_token_id = int(pad_id if pad_id is not None else self.model.config.eos_token_id)
        self.batch_size = batch_size

    def run(self, workload: WorkloadLike) -> list[list[int]]:
        # Batches are cut in workload order, not sorted by length: a user of
        # generate() rarely knows the answer lengths in advance either.
        tokens: list[list[int]] = []
        for start in range(0, len(workload.prompts), self.batch_size):
            prompts = workload.prompts[start : start + self.batch_size]
            wanted = workload.max_tokens[start : start + self.batch_size]
            # A static batch runs until its longest request is done; shorter
            # requests keep decoding (wasted work) and are trimmed afterwards.
            rows = self._generate_batch(prompts, max(wanted))
            tokens.extend(row[:m] for row, m in zip(rows, wanted))
        check_lengths(self.name, tokens, workload.max_tokens)
        return tokens

    def _generate_batch(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """One ``generate`` call; returns each row's ``new_tokens`` generated ids."""
        # Left padding, so every row's last prompt token sits in the same column
        # and the first generated token of all rows is appended at once.
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)  # [batch, width]
        attention_mask = torch.zeros_like(input_ids)  # 1 = real token, 0 = left padding
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                # min == max: EOS cannot end a row early, like ignore_eos.
                min_new_tokens=new_tokens,
                max_new_tokens=new_tokens,
                pad_token_id=self.pad_token_id,
            )  # [batch, width + new_tokens]
        return [row.tolist() for row in out[:, width:]]

    def greedy_reference(self, prompt: list[int], num_tokens: int) -> list[int]:
        """Plain greedy decoding of one unpadded prompt, the ground truth for agreement.

        Not ``generate(min_new_tokens=...)``: that masks EOS out of the logits, while
        ``ignore_eos`` lets the engine pick EOS and keep going, so the two would
        legitimately differ wherever EOS is the argmax.
        """
        tokens: list[int] = []
        with torch.inference_mode():
            out = self.model(torch.tensor([prompt]), use_cache=True)
            while True:
                tokens.append(int(out.logits[0, -1].argmax()))  # logits: [1, seq, vocab]
                if len(tokens) == num_tokens:
                    return tokens
                step = torch.tensor([[tokens[-1]]])  # [1, 1]
                out = self.model(step, cache=out.cache, use_cache=True)
