"""Gemma 3 270M on its Q4_K_M GGUF: nanoengine's greedy tokens against Hugging Face transformers'.

Chapter 4 (a model of local and global layers) and chapter 2 (GGUF blocks).
Needs the prepared model (``python scripts/prepare_model.py gemma-3-270m``;
Gemma is provided under and subject to the Gemma Terms of Use,
https://ai.google.dev/gemma/terms). Both sides read the same file:
transformers dequantizes every block to float32 at load; nanoengine keeps
the blocks (Q5_0, Q8_0, Q4_K, Q6_K; a fused q/k/v with v in Q8_0 is kept in
Q8_0, exactly) and multiplies them with its C++ kernels, in float32. The
script prints:

* the model as the engine reads it: parameters, layers and their kinds,
  the sliding window, the vocabulary, and the bytes its weights keep;
* greedy agreement over the prompts below, ``--tokens`` tokens each: the
  notes' two Chinese prompts, English ones, and one long prompt of over 600
  tokens, so that the local layers' 512-token window is really slid over;
  at each first divergence, how far transformers' own logits put its token
  above the engine's (a small gap is a near tie);
* what the base model writes for the notes' two Chinese prompts.

    python scripts/gemma_parity.py [--tokens 32]

vLLM 0.32 counterpart: none (vLLM's model tests compare with transformers
the same way: ``tests/models/utils.py``, ``check_logprobs_close``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from chapters._common import engine_parts
from nanoengine import LLM, SamplingParams
from nanoengine.inputs import TokensPrompt
from nanoengine.platforms.cpu import describe_cpu, kernel_isa
from nanoengine.transformers_utils.config import resolve_model_path

MODEL = "gemma-3-270m"
CHINESE = ["你好，请用一句话介绍你自己", "写一个把列表倒序的 Python 函数"]  # chapter 1's prompts
ENGLISH = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colours are",
    "Water boils at",
    "The largest planet in the solar system is",
]
# Over 600 tokens: the local layers read only the last 512 of them.
LONG = "Here is a list of the days of the week, repeated: " + "Monday, Tuesday, Wednesday, Thursday, Friday. " * 60


def hf_greedy(model: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=False)  # [1, len + new], past any EOS as the engine's ignore_eos
            outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def gap_at(model: Any, prompt: list[int], theirs: list[int], ours: list[int], first: int) -> float:
    """transformers' logit of its token minus the engine's token's, at the first divergence."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + theirs[:first]])).logits[0, -1]  # [vocab]
    return float(logits[theirs[first]] - logits[ours[first]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    folder = resolve_model_path(MODEL)
    print(f"{describe_cpu()}; kernel variant {kernel_isa()}")
    started = time.perf_counter()
    llm = LLM(MODEL, dtype="float32", max_model_len=1024)
    print(f"engine loaded in {time.perf_counter() - started:.1f} s")
    config = llm.llm_engine.engine_config.model_config.hf_config
    kinds = config.layer_types
    print(f"{config.num_hidden_layers} layers ({kinds.count('sliding_attention')} local, window "
          f"{config.sliding_window}; {kinds.count('full_attention')} global), vocabulary {config.vocab_size:,}")
    _, runner = engine_parts(llm)
    assert runner.model is not None, "loaded"
    kept = sum(int(p.numel()) * p.element_size() for p in runner.model.parameters())
    print(f"weights kept: {kept / 2**20:.0f} MiB (the tied head shares the embedding's Q8_0 blocks)")
    tokenizer = llm.get_tokenizer()
    texts = CHINESE + ENGLISH + [LONG]
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    print(f"prompts: {len(prompts)}, the long one {len(prompts[-1])} tokens")

    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False)
    ours = [list(o.outputs[0].token_ids) for o in outs]
    del llm

    started = time.perf_counter()
    gguf = next(p.name for p in Path(folder).glob("*.gguf"))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).eval()
    print(f"transformers loaded (dequantized to float32) in {time.perf_counter() - started:.1f} s: "
          f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters")
    theirs = hf_greedy(model, prompts, args.tokens)

    equal_tokens = 0
    for text, prompt, a, b in zip(texts, prompts, ours, theirs):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        equal_tokens += len(a) if first is None else first
        verdict = "equal" if first is None else f"first divergence at token {first}, " \
            f"transformers' token leads by {gap_at(model, prompt, b, a, first):.3f} logits"
        print(f"  {text[:40]!r:44} {verdict}")
    total = sum(len(b) for b in theirs)
    print(f"greedy tokens equal to transformers' (up to each first divergence): {equal_tokens}/{total}")
    for text, tokens in zip(CHINESE, ours):
        print(f"{text} -> {tokenizer.decode(tokens, skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
