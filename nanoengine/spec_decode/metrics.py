"""SpecDecodingStats: how many drafted tokens the target model kept.

Chapter 9. The scheduler counts, for every request that had drafts verified in
a step, the drafts and the accepted ones, also per draft position (position 1
is the first guess after the last known token). Two figures follow:

* acceptance rate = accepted tokens / drafted tokens;
* mean acceptance length = 1 + accepted tokens / drafts: the tokens one
  verification step emits on average (the 1 is the target's own token).

The counts are cumulative, like the prefix-cache counters: ``/metrics`` exports
them as vLLM's ``vllm:spec_decode_*`` counters, and chapter 9 prints them.
Pure Python (``core/`` reads it and stays free of torch).

vLLM 0.32 counterpart: ``vllm/v1/spec_decode/metrics.py`` (``SpecDecodingStats``,
with ``new`` and ``observe_draft``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Draft and acceptance counts; per-position lists have one entry per draft slot."""

    num_spec_tokens: int
    num_drafts: int = 0  # verification steps of a request that had drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        return cls(
            num_spec_tokens=num_spec_tokens,
            num_accepted_tokens_per_pos=[0] * num_spec_tokens,
            num_draft_tokens_per_pos=[0] * num_spec_tokens,
        )

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification: drafts 1..num_accepted_tokens were kept."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(
                f"need 0 <= accepted ({num_accepted_tokens}) <= drafted ({num_draft_tokens}) "
                f"<= num_spec_tokens ({self.num_spec_tokens})."
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1
        for position in range(num_draft_tokens):
            self.num_draft_tokens_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens; None before any draft was verified."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verification step (accepted drafts plus the target's own)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@dataclass
class RequestSpecDecodeMetrics:
    """One request's verification steps: how many drafts each kept, and all drafted.

    ``histogram[j]`` counts the steps that kept exactly ``j`` drafts. The
    output processor hands it to the user on the finished ``CompletionOutput``
    (``spec_decode_metrics``), so a benchmark can print each request's rate.
    vLLM 0.32 fills the same field only with ``--per-request-spec-decode-metrics``;
    nanoengine always does, as it is a few integers per request.
    """

    num_spec_tokens: int
    histogram: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0

    @classmethod
    def new(cls, num_spec_tokens: int) -> RequestSpecDecodeMetrics:
        return cls(num_spec_tokens=num_spec_tokens, histogram=[0] * (num_spec_tokens + 1))

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.histogram[num_accepted] += 1
        self.num_draft_tokens += num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        return sum(j * count for j, count in enumerate(self.histogram))

    @property
    def acceptance_rate(self) -> float | None:
        """Kept drafts over drafted tokens; None if nothing was drafted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None
