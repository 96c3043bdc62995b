"""What the live view costs the engine: throughput with no page, with a page connected, after it left.

Two offline ``LLM``s of the same model run the same batch in turns: one never
had a page (nothing attached), the other serves ``llm.serve_ui()`` with a
reader connected to its feed for the whole run (a separate process reading the
server-sent events as a browser tab would, so the reading itself does not take
this process's interpreter lock). After the rounds the reader leaves, the
feed goes idle (``LiveFeed`` stops building frames after ``IDLE_S``), and the
rounds run again. Printed: generated tokens per second (medians of the
rounds), each watched figure against the plain engine's of the same rounds,
the frames the reader received, and the CPU's flags.

    .venv/bin/python scripts/bench_live_view.py [--model M] [--rounds 3] [--batch 8] [--max-tokens 64]

Issue goal: a connected page costs at most 3% throughput, no page costs nothing.
Chapter: 3-5 (the live view); vLLM 0.32 counterpart: none.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import textwrap
import time

from nanoengine import LLM, SamplingParams
from nanoengine.instruments.live_view.feed import IDLE_S
from nanoengine.platforms.cpu import describe_cpu

PROMPT = "Write a short story about a scheduler that hands out tokens to requests, one step at a time."
# The reader: counts frame events until told to stop (its stdin closes), then prints the count.
READER = textwrap.dedent("""
    import sys, threading, httpx
    count = [0]
    def read():
        with httpx.stream("GET", sys.argv[1], timeout=None) as stream:
            for line in stream.iter_lines():
                if line == "event: frame":
                    count[0] += 1
    threading.Thread(target=read, daemon=True).start()
    sys.stdin.read()
    print(count[0])
""")


def throughput(llm: LLM, batch: int, max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([PROMPT] * batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return sum(len(output.outputs[0].token_ids) for output in outputs) / elapsed


def rounds_of(plain: LLM, watched: LLM, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """``args.rounds`` turns of both engines: (no page, watched) tokens per second."""
    results: tuple[list[float], list[float]] = ([], [])
    for _ in range(args.rounds):
        results[0].append(throughput(plain, args.batch, args.max_tokens))
        results[1].append(throughput(watched, args.batch, args.max_tokens))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    print(describe_cpu())
    plain = LLM(args.model, dtype=args.dtype)
    watched = LLM(args.model, dtype=args.dtype)
    ui = watched.serve_ui(allow_control=False)
    reader = subprocess.Popen([sys.executable, "-c", READER, ui.url + "/api/feed"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for llm in (plain, watched):  # warm-up: kernels, caches
        throughput(llm, args.batch, 8)
    connected = rounds_of(plain, watched, args)
    frames, _ = reader.communicate("", timeout=30)
    time.sleep(IDLE_S + 1)  # the feed notices nobody reads any more
    gone = rounds_of(plain, watched, args)
    ui.close()
    print(f"{args.model}, {args.dtype}, batch {args.batch}, {args.max_tokens} tokens each, medians of "
          f"{args.rounds} rounds, each against the engine with no page run in turn beside it")
    for name, (base, other) in {"page connected": connected, "page gone": gone}.items():
        ratio = statistics.median(other) / statistics.median(base)
        print(f"  {name:15s} {statistics.median(other):7.1f} tok/s against {statistics.median(base):7.1f} "
              f"with no page: {ratio:.3f}x   ({', '.join(f'{v:.1f}' for v in other)} / "
              f"{', '.join(f'{v:.1f}' for v in base)})")
    print(f"  the reader received {frames.strip()} frames")


if __name__ == "__main__":
    main()
