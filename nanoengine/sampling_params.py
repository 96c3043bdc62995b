"""SamplingParams: how one request wants its tokens chosen and when it must stop.

Chapter 1 (quickstart) introduces it; chapter 7 shows where the sampler reads it.
vLLM 0.32 counterpart: ``vllm/sampling_params.py`` (``SamplingParams``).

The class is pure data plus validation. It never touches torch, so the scheduler
(which reads ``max_tokens``, ``stop_token_ids`` ...) stays device-free.
Validation happens in ``__post_init__`` so a bad value fails where the user wrote
it, with a message that names the value and the allowed range.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nanoengine.exceptions import ValidationError

# Sampling with a temperature this close to zero is treated as greedy: dividing
# logits by ~0 would overflow, and argmax is what the user means anyway.
_GREEDY_EPS = 1e-5
# The most top logprobs one position may ask for (``logprobs``, ``prompt_logprobs``):
# OpenAI's limit, and vLLM's default ``max_logprobs``.
MAX_LOGPROBS = 20
# The most samples one request may ask for (vLLM's VLLM_MAX_N_SEQUENCES default).
MAX_N = 16384
# OpenAI's range for one logit_bias entry: +-100 bans or forces a token.
MAX_ABS_LOGIT_BIAS = 100.0
# OpenAI's range for presence_penalty and frequency_penalty.
MAX_ABS_PENALTY = 2.0


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a running request holds (chapter 8).

    CUMULATIVE: everything generated so far (the offline default); DELTA: only
    what is new since the previous output (a server streams these);
    FINAL_ONLY: nothing until the request finishes, then everything.
    vLLM 0.32 counterpart: ``RequestOutputKind`` in ``vllm/sampling_params.py``.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar: exactly one of ``choice``, ``regex``, ``json``.

    Chapter 5: such a request waits in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    until its grammar is compiled. ``json`` is a JSON schema (dict or string).
    vLLM 0.32 counterpart: ``StructuredOutputsParams`` in ``vllm/sampling_params.py``.
    """

    choice: list[str] | None = None
    regex: str | None = None
    json: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("choice", "regex", "json") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValidationError(f"StructuredOutputsParams needs exactly one of choice, regex, json; got {given}.",
                                  parameter="structured_outputs")
        if self.choice is not None and (
            not self.choice or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise ValidationError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}.",
                                  parameter="structured_outputs")

    def json_schema_text(self) -> str:
        """The schema as the JSON text a grammar compiler reads."""
        return self.json if isinstance(self.json, str) else json.dumps(self.json)


@dataclass(frozen=True)
class RepetitionDetectionParams:
    """Stop a request whose output ends in a pattern repeated ``min_count`` times.

    A pattern is any run of ``min_pattern_size`` to ``max_pattern_size`` tokens;
    the request ends as FINISHED_REPETITION ("repetition" to the user).
    vLLM 0.32 counterpart: ``RepetitionDetectionParams`` in ``vllm/sampling_params.py``.
    """

    max_pattern_size: int
    min_pattern_size: int = 1
    min_count: int = 2

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            _check_int(name, getattr(self, name))
        if not 1 <= self.min_pattern_size <= self.max_pattern_size:
            raise ValueError(
                f"need 1 <= min_pattern_size <= max_pattern_size, got {self.min_pattern_size} "
                f"and {self.max_pattern_size}."
            )
        if self.min_count < 2:
            raise ValueError(f"min_count must be at least 2 (one occurrence is no repeat), got {self.min_count}.")


@dataclass
class SamplingParams:
    """Per-request decoding options, a subset of vLLM's with the same names and defaults."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    # -1 disables top-k. (vLLM 0.32 also accepts 0 for "disabled"; nanoengine treats
    # 0 as the mistake it usually is and asks for -1 explicitly.)
    top_k: int = -1
    # Drop tokens less likely than min_p times the most likely one (0 disables).
    min_p: float = 0.0
    # OpenAI's penalties on the output so far: presence subtracts a constant from
    # every token already generated, frequency subtracts per occurrence.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF's penalty on prompt and output tokens: > 1 discourages repeating them.
    repetition_penalty: float = 1.0
    # token id -> value added to its logit before anything else (OpenAI logit_bias).
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    # Top logprobs to return per generated token, besides the sampled token's own
    # (0 = only the sampled token's); None returns none. At most MAX_LOGPROBS.
    logprobs: int | None = None
    # The same for every prompt token (the first has none: nothing precedes it).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    # What each RequestOutput holds: all so far, only what is new, or only the end.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Scheduling priority (lower value = served first) used by the priority policy.
    priority: int = 0
    # Grammar-constrained decoding (choice / regex / JSON schema), chapter 5.
    structured_outputs: StructuredOutputsParams | None = None
    # Stop when the output falls into a loop, chapter 5.
    repetition_detection: RepetitionDetectionParams | None = None
    # Anything else a component reads by key, as in vLLM; chapter 10's KV
    # connector reads "kv_transfer_params" (the server copies the request field here).
    extra_args: dict[str, Any] | None = None
    # Filled in by the input processor from the model's generation config, so the
    # scheduler can stop on any EOS id without knowing about tokenizers.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        # Normalise the two "str or list" conveniences first, as vLLM does.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self._verify()
        # A union, not an assignment: a copy decoded from the engine core's
        # socket (chapter 8) arrives with the EOS ids already filled in.
        self.all_stop_token_ids = set(self.all_stop_token_ids) | set(self.stop_token_ids)

    def _verify(self) -> None:
        """Reject values no sampler could honour; each message names value and limit."""
        _check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ValidationError(f"n must be in [1, {MAX_N}], got {self.n}.", parameter="n")
        if _check_finite("temperature", self.temperature) < 0.0:
            raise ValidationError(f"temperature must be non-negative, got {self.temperature}.", parameter="temperature")
        if self.n > 1 and self.temperature < _GREEDY_EPS:
            # n greedy samples would be n copies of one answer: almost surely a mistake.
            raise ValidationError(f"n must be 1 when using greedy sampling (temperature=0), got {self.n}.",
                                  parameter="n")
        if not 0.0 < _check_finite("top_p", self.top_p) <= 1.0:
            raise ValidationError(f"top_p must be in (0, 1], got {self.top_p}.", parameter="top_p")
        _check_int("top_k", self.top_k)
        if self.top_k < -1 or self.top_k == 0:
            raise ValidationError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.", parameter="top_k")
        self._verify_penalties()
        for name in ("logprobs", "prompt_logprobs"):
            _check_logprobs_count(name, getattr(self, name))
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {type(self.output_kind).__name__}.")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValidationError(f"max_tokens must be at least 1, got {self.max_tokens}.", parameter="max_tokens")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValidationError(f"min_tokens must be non-negative, got {self.min_tokens}.", parameter="min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValidationError(
                f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}.",
                parameter="min_tokens",
            )
        if self.seed is not None:
            _check_int("seed", self.seed)
        assert isinstance(self.stop, list) and isinstance(self.stop_token_ids, list)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValidationError(f"stop must hold non-empty strings, got {self.stop!r}.", parameter="stop")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids entry", token_id)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}."
            )
        if self.repetition_detection is not None and not isinstance(
            self.repetition_detection, RepetitionDetectionParams
        ):
            raise TypeError(
                "repetition_detection must be a RepetitionDetectionParams, got "
                f"{type(self.repetition_detection).__name__}."
            )

    def _verify_penalties(self) -> None:
        """min_p, the three penalties and logit_bias, each against its range."""
        if not 0.0 <= _check_finite("min_p", self.min_p) <= 1.0:
            raise ValidationError(f"min_p must be in [0, 1], got {self.min_p}.", parameter="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_finite(name, getattr(self, name))
            if abs(value) > MAX_ABS_PENALTY:
                limit = f"{MAX_ABS_PENALTY:g}"
                raise ValidationError(f"{name} must be in [-{limit}, {limit}], got {getattr(self, name)}.", parameter=name)
        if _check_finite("repetition_penalty", self.repetition_penalty) <= 0.0:
            raise ValidationError(
                f"repetition_penalty must be greater than 0, got {self.repetition_penalty}.",
                parameter="repetition_penalty",
            )
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        """True when the sampler may take argmax: no randomness is asked for."""
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def clone(self) -> SamplingParams:
        """A copy a request may own (the engine fills ``all_stop_token_ids`` in place)."""
        copy = SamplingParams(**{k: v for k, v in self.__dict__.items() if k != "all_stop_token_ids"})
        copy.all_stop_token_ids = set(self.all_stop_token_ids)
        return copy


def _check_int(name: str, value: object) -> None:
    """bool is an int subclass in Python; reject it along with floats and strings. An int
    travels to the engine core as a 64-bit integer (msgpack), so it must fit in one."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
    if not -(2**63) <= value < 2**63:
        raise ValidationError(f"{name} must fit in a signed 64-bit integer, got {value}.", parameter=name)


def _check_finite(name: str, value: object) -> float:
    """An int or float that is a real number: NaN compares False with every limit,
    so without this check a NaN would slip past all the range tests.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}.")
    if not math.isfinite(value):
        raise ValidationError(f"{name} must be a finite number, got {value}.", parameter=name)
    return float(value)


def _check_logprobs_count(name: str, value: int | None) -> None:
    if value is None:
        return
    _check_int(name, value)
    if not 0 <= value <= MAX_LOGPROBS:
        raise ValidationError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}.", parameter=name)


def _checked_logit_bias(logit_bias: object) -> dict[int, float]:
    """A fresh {int token id: float bias} with every bias within +-MAX_ABS_LOGIT_BIAS.

    Token ids are checked against the vocabulary later, by the input processor,
    which knows its size.
    """
    if not isinstance(logit_bias, Mapping):
        raise TypeError(f"logit_bias must be a dict of token id to bias, got {type(logit_bias).__name__}.")
    checked: dict[int, float] = {}
    for token_id, bias in logit_bias.items():
        _check_int("logit_bias token id", token_id)
        value = _check_finite(f"logit_bias[{token_id}]", bias)
        if abs(value) > MAX_ABS_LOGIT_BIAS:
            limit = f"{MAX_ABS_LOGIT_BIAS:g}"
            raise ValidationError(f"logit_bias[{token_id}] must be in [-{limit}, {limit}], got {bias}.",
                                  parameter="logit_bias")
        checked[token_id] = value
    return checked
