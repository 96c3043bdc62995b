"""InputProcessor: check a rendered prompt and its parameters, make an EngineCoreRequest.

Chapter 7 (``generate(...)``) starts each request here. Everything that could
make the engine fail later is checked now, while the error can still be raised
to the caller without disturbing the requests already running.
vLLM 0.32 counterpart: ``vllm/v1/engine/input_processor.py`` (``InputProcessor``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from nanoengine.config import ModelConfig
from nanoengine.distributed.kv_transfer.base import KVConnectorScheduler
from nanoengine.engine import EngineCoreRequest
from nanoengine.exceptions import ValidationError
from nanoengine.renderers.hf import RenderedPrompt
from nanoengine.sampling_params import SamplingParams


class InputProcessor:
    """Validates against the model's limits and fills in engine-side defaults."""

    def __init__(
        self, model_config: ModelConfig, eos_token_ids: Iterable[int], async_scheduling: bool = False,
        kv_connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.model_config = model_config
        # The tokenizer's EOS and any extra ones from generation_config.json.
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.async_scheduling = async_scheduling
        # Chapter 10: a copy of the scheduler side of the engine's KV connector,
        # used here only to refuse kv_transfer_params it could not act on.
        self.kv_connector = kv_connector

    def process_inputs(
        self,
        request_id: str,
        rendered: RenderedPrompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}.")
        if self.async_scheduling and params.structured_outputs is not None:
            # The grammar must accept step N's token before it can mask step
            # N+1's logits, but async scheduling launches step N+1 before that
            # token is known (chapter 7).
            raise ValueError("structured_outputs cannot be combined with async_scheduling=True.")
        self._validate_params(params)
        prompt_ids = rendered["prompt_token_ids"]
        self._validate_prompt(prompt_ids)
        self._validate_kv_transfer_params(params, len(prompt_ids))
        params = params.clone()
        self._fill_engine_defaults(params, len(prompt_ids))
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            priority=priority,
        )

    def _validate_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids and counts against the
        vocabulary, and what needs the tokenizer the engine may not have.
        """
        self._validate_needs_tokenizer(params)
        vocab = self.model_config.vocab_size
        # Both become indices into the logits (a bias added, a stop token masked
        # under min_tokens): one outside the vocabulary would crash the core's step.
        for name, token_ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            for token_id in token_ids or ():
                if not 0 <= token_id < vocab:
                    raise ValidationError(
                        f"{name} token id {token_id} is out of vocabulary (vocab size {vocab}, "
                        f"valid ids are 0..{vocab - 1}).", parameter=name)
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(params, name)
            if count is not None and count > vocab:
                raise ValueError(f"{name}={count} asks for more tokens than the vocabulary has ({vocab}).")

    def _validate_kv_transfer_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """vLLM's disaggregation fields: a dict; acted on, and so checked, only with a KV connector."""
        kv_params = (params.extra_args or {}).get("kv_transfer_params")
        if kv_params is None:
            return
        if not isinstance(kv_params, dict):
            raise ValidationError(f"kv_transfer_params must be a JSON object, got {kv_params!r:.100}.",
                                  parameter="kv_transfer_params")
        # Without a connector vLLM ignores them, and so does the scheduler here.
        if self.kv_connector is not None:
            self.kv_connector.validate_request(kv_params, num_prompt_tokens)

    def _validate_needs_tokenizer(self, params: SamplingParams) -> None:
        """With ``skip_tokenizer_init=True`` there is no text to match a stop string
        against and no vocabulary to compile a grammar over (chapter 6)."""
        if not self.model_config.skip_tokenizer_init:
            return
        if params.stop:
            raise ValueError(
                "Stop strings need a tokenizer, and this engine was built with skip_tokenizer_init=True; "
                "use stop_token_ids instead."
            )
        if params.structured_outputs is not None:
            raise ValueError(
                "structured_outputs needs a tokenizer, and this engine was built with skip_tokenizer_init=True."
            )

    def _validate_prompt(self, prompt_ids: list[int]) -> None:
        max_len = self.model_config.max_model_len
        if not prompt_ids:
            raise ValueError("The prompt is empty (0 tokens); at least 1 token is needed.")
        if len(prompt_ids) > max_len:
            raise ValidationError(
                f"The prompt is {len(prompt_ids)} tokens long, longer than max_model_len={max_len}.",
                parameter="input_tokens",
            )
        self.validate_token_ids(prompt_ids)

    def validate_token_ids(self, prompt_ids: list[int]) -> None:
        """Every id an int inside the vocabulary, and at least one of them."""
        vocab = self.model_config.vocab_size
        if not prompt_ids:
            raise ValueError("The prompt piece is empty (0 tokens); at least 1 token is needed.")
        for token_id in prompt_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise TypeError(f"Token ids must be ints, got {type(token_id).__name__} {token_id!r}.")
            if not 0 <= token_id < vocab:
                raise ValueError(f"Token id {token_id} is out of vocabulary (valid ids are 0..{vocab - 1}).")

    def _fill_engine_defaults(self, params: SamplingParams, prompt_len: int) -> None:
        """EOS joins the stop ids unless ignored; max_tokens=None means "until the
        context is full".
        """
        if not params.ignore_eos:
            params.all_stop_token_ids.update(self.eos_token_ids)
        room = self.model_config.max_model_len - prompt_len
        if params.max_tokens is None:
            params.max_tokens = max(room, 1)
            # Checked here, not only in SamplingParams: the core re-checks the params
            # it decodes, and a request refused there would never answer.
            if params.min_tokens > params.max_tokens:
                raise ValidationError(
                    f"min_tokens={params.min_tokens} is more than the {params.max_tokens} tokens left in the "
                    f"context (max_model_len={self.model_config.max_model_len}).", parameter="min_tokens")
