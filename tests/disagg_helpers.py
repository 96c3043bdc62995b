"""Prefill servers, decode servers and the proxy, started together for a test (chapter 10).

Every process binds 127.0.0.1 on a free port; ``running_processes`` stops them
all and checks that no engine core or rank outlives its server.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
from server_helpers import API_KEY, NANOENGINE, free_port_run, serve_command

MAX_MODEL_LEN = 2048
# fp32: in bf16 the decode side's own pass over the last prompt token rounds differently
# from a colocated prefill's, enough to flip a near-tie of the random tiny model.
SERVE_FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--block-size", "16", "--served-model-name", "m",
               "--dtype", "float32", "--uvicorn-log-level", "warning")


def long_context_model(tiny_model: str, tmp_path: Path) -> str:
    """The tiny test model with room for 2,048 positions (RoPE needs nothing else)."""
    target = tmp_path / "tiny-llama-2k"
    if not target.exists():
        shutil.copytree(tiny_model, target)
        config = json.loads((target / "config.json").read_text())
        config["max_position_embeddings"] = MAX_MODEL_LEN
        (target / "config.json").write_text(json.dumps(config))
    return str(target)


def kv_config(role: str, **fields: Any) -> str:
    """``--kv-transfer-config`` for the ZmqConnector; a producer gets free ports of its own
    (one per rank, up to the two ranks the tensor-parallel test runs)."""
    config: dict[str, Any] = {"kv_connector": "ZmqConnector", "kv_role": role, **fields}
    if role == "kv_producer":
        config.setdefault("kv_port", free_port_run(2))
    return json.dumps(config)


def producer(model: str, *flags: str, **fields: Any) -> list[str]:
    return serve_command(model, *SERVE_FLAGS, *flags, "--kv-transfer-config", kv_config("kv_producer", **fields))


def consumer(model: str, *flags: str, **fields: Any) -> list[str]:
    return serve_command(model, *SERVE_FLAGS, *flags, "--kv-transfer-config", kv_config("kv_consumer", **fields))


def colocated(model: str, *flags: str) -> list[str]:
    return serve_command(model, *SERVE_FLAGS, *flags)


def proxy(prefill_port: int, decode_port: int) -> list[str]:
    return [NANOENGINE, "proxy", "--prefill", f"http://127.0.0.1:{prefill_port}",
            "--decode", f"http://127.0.0.1:{decode_port}", "--port", "{port}"]


def completion(base_url: str, prompt: list[int], max_tokens: int, stream: bool = False,
               timeout: float = 120.0, **body: Any) -> dict[str, Any]:
    """A greedy completion; a stream is joined into ``{"token_ids": [...]}``; an error is its JSON."""
    request = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
               "return_token_ids": True, "stream": stream, **body}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if not stream:
        return httpx.post(f"{base_url}/v1/completions", json=request, headers=headers, timeout=timeout).json()
    token_ids: list[int] = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=request, headers=headers, timeout=timeout) as reply:
        if reply.status_code != 200:  # refused before the stream began: OpenAI's error JSON
            reply.read()
            return dict(reply.json())
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    return chunk
                token_ids += chunk["choices"][0].get("token_ids") or []
    return {"token_ids": token_ids}


def token_ids(answer: dict[str, Any]) -> list[int]:
    if "choices" in answer:
        return list(answer["choices"][0]["token_ids"])
    if "token_ids" in answer:
        return list(answer["token_ids"])
    raise AssertionError(f"no tokens in {answer}")

