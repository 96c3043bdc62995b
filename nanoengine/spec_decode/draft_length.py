"""How many of a request's drafts to verify: a draft is worth its row only if it is likely kept.

Chapter 9 ("When speculation does not pay"). Verifying a draft is not free on
a CPU: each draft adds one query row to the next forward pass, and every row
costs arithmetic in every linear layer. On the 2-core EPYC of these notes one
extra row costs about a fifteenth of a one-request decode step, and about half
of one token's share of an eight-request step. A draft that is rarely kept
therefore slows the request down, and speculation can lose to plain decoding.

``DraftLengthPolicy`` cuts each request's draft, step by step, to the drafts
that are expected to pay. Two things are estimated from what the engine has
seen, nothing is assumed about the machine:

* **What a row costs.** ``StepCostModel`` keeps the measured time of decode
  steps per number of query rows and fits a line, ``seconds = a + b * rows``,
  over the row counts near the coming step.
* **How likely each draft is kept.** ``AcceptanceEstimate`` counts, per
  request, the drafts kept and the first draft rejected in each step. If each
  draft is kept with probability ``alpha``, the draft at index ``j`` of a step
  (counting from 0, as chapter 9 does) is used only if the ``j`` before it
  were kept too: probability ``alpha ** (j + 1)``.

The rule: a step with ``N`` expected tokens and ``T`` expected seconds gains by
one more draft worth ``p`` expected tokens and ``b`` seconds exactly when
``(N + p) / (T + b) > N / T``, that is when ``p > b * N / T``. All requests'
candidate drafts are offered in order of ``p``, largest first, until one fails.
One exception explores: a request whose own evidence has faded to almost
nothing verifies its first draft whatever the rule says. Without it a request
the rule never tries would never be measured, and where rows are dear (a large
batch) an engine that starts doubtful would never try any draft at all.
Counts fade by ``decay`` every step, towards the whole engine's acceptance, so
a request whose drafts were all cut gets drafts again if requests like it are
keeping theirs. Greedy text stays exactly the target's, and sampled text keeps
exactly the target's distribution: the rejection sampler is exact for any
draft length. But the lengths follow measured times, so a seeded sampled run
may draw different random numbers from one run to the next;
``SpeculativeConfig(draft_length="fixed")`` verifies every draft and repeats.

vLLM 0.32 counterpart: none that adapts to acceptance. vLLM verifies every
draft the proposer returns (``num_speculative_tokens`` of them when it finds a
match); its one knob on draft length is ``num_speculative_tokens_per_batch_size``
(``vllm/config/speculative.py``, looked up by the scheduler through
``vllm/v1/spec_decode/dynamic/utils.py``), a table from batch size to draft
length that the user writes, which nanoengine takes too (``cap_for_batch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

# Per step, old evidence keeps this share of its weight: about the last ten
# steps of a request decide, so a request that stops copying is noticed soon.
DECAY = 0.9
# Pseudo-counts of the engine-wide rate in every request's estimate: a new
# request starts at the engine's rate, and a request without drafts returns to it.
PRIOR_WEIGHT = 2.0
# A request whose own kept-plus-rejected count is below this probes its first
# draft: a new request at once, and one cut after a rejection again once the
# evidence has faded for about twenty steps (0.9 ** 22 < 0.1).
PROBE_BELOW = 0.1


@dataclass
class AcceptanceEstimate:
    """Decayed counts of kept drafts and of first rejections (geometric model)."""

    kept: float = 0.0
    rejected: float = 0.0

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.kept += num_accepted
        # The drafts after the first rejected one were never judged: no evidence.
        self.rejected += 1.0 if num_accepted < num_drafted else 0.0

    @property
    def evidence(self) -> float:
        """How many judged drafts the estimate rests on, faded."""
        return self.kept + self.rejected

    def fade(self, decay: float) -> None:
        self.kept *= decay
        self.rejected *= decay

    def rate(self, prior: float, prior_weight: float = PRIOR_WEIGHT) -> float:
        """The chance one draft is kept: this request's counts over the prior's."""
        return (self.kept + prior_weight * prior) / (self.evidence + prior_weight)


@dataclass
class StepCostModel:
    """Seconds of a decode step as a line in its number of query rows."""

    decay: float = DECAY
    # rows -> decayed mean seconds of the decode steps with that many rows.
    seconds_by_rows: dict[int, float] = field(default_factory=dict)

    def observe(self, num_rows: int, seconds: float) -> None:
        old = self.seconds_by_rows.get(num_rows)
        self.seconds_by_rows[num_rows] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def line(self, low: int, high: int) -> tuple[float, float] | None:
        """``(a, b)`` of ``seconds = a + b * rows``, least squares over the row
        counts seen in ``[low, high]`` (all seen, if fewer than two are there);
        None until two row counts have been seen."""
        points = [(r, s) for r, s in self.seconds_by_rows.items() if low <= r <= high]
        if len(points) < 2:
            points = list(self.seconds_by_rows.items())
        if len(points) < 2:
            return None
        mean_r = sum(r for r, _ in points) / len(points)
        mean_s = sum(s for _, s in points) / len(points)
        spread = sum((r - mean_r) ** 2 for r, _ in points)
        slope = sum((r - mean_r) * (s - mean_s) for r, s in points) / spread
        return mean_s - slope * mean_r, slope


class _Offer(NamedTuple):
    """One draft the policy may verify: its expected tokens, whose it is."""

    worth: float  # the chance it is kept, rate ** (j + 1) for the draft at index j
    request: int  # its place in the batch
    probe: bool  # verified whatever it is worth: the request's evidence has faded


class DraftLengthPolicy:
    """Chooses, each step, how many of each request's drafts the target verifies."""

    def __init__(self, max_drafts: int, decay: float = DECAY) -> None:
        self.max_drafts = max_drafts
        self.decay = decay
        self.cost = StepCostModel(decay)
        self.engine_wide = AcceptanceEstimate()
        self.by_request: dict[str, AcceptanceEstimate] = {}

    def observe_step(self, num_rows: int, seconds: float) -> None:
        """A decode step's rows (every request's token plus its drafts) and its time."""
        self.cost.observe(num_rows, seconds)

    def observe_verified(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        self.by_request.setdefault(req_id, AcceptanceEstimate()).observe(num_drafted, num_accepted)
        self.engine_wide.observe(num_drafted, num_accepted)

    def forget(self, req_id: str) -> None:
        self.by_request.pop(req_id, None)

    def acceptance_rate(self, req_id: str) -> float:
        """This request's chance of keeping a draft; the engine's (from an even
        start) for a request not verified yet."""
        estimate = self.by_request.get(req_id, AcceptanceEstimate())
        return estimate.rate(self.engine_wide.rate(prior=0.5, prior_weight=1.0))

    def choose(self, req_ids: Sequence[str], num_proposed: Sequence[int]) -> list[int]:
        """How many of each request's proposed drafts to verify next step.

        req_ids: the requests that decode next step; num_proposed: the length
        of each one's draft. Every step fades the evidence first.
        """
        for estimate in (*self.by_request.values(), self.engine_wide):
            estimate.fade(self.decay)
        num_reqs = len(req_ids)
        line = self.cost.line(num_reqs, num_reqs * (1 + self.max_drafts))
        if line is None or line[1] <= 0.0:
            return list(num_proposed)  # rows cost nothing measurable (yet): verify them all
        start, per_row = line
        # Request i's draft at index j is used with probability rate_i ** (j + 1).
        offers = []
        for index, (req_id, proposed) in enumerate(zip(req_ids, num_proposed)):
            rate = self.acceptance_rate(req_id)
            probe = self.by_request.get(req_id, AcceptanceEstimate()).evidence < PROBE_BELOW
            offers += [_Offer(rate ** (j + 1), index, probe and j == 0) for j in range(proposed)]
        offers.sort(key=lambda offer: (not offer.probe, -offer.worth))  # probes first
        chosen = [0] * num_reqs
        tokens, seconds = float(num_reqs), start + per_row * num_reqs
        for worth, request, probe in offers:
            if not probe and worth * seconds <= per_row * tokens:
                break  # this draft, and every later one, lowers tokens per second
            chosen[request] += 1
            tokens, seconds = tokens + worth, seconds + per_row
        return chosen


def cap_for_batch(schedule: Sequence[tuple[int, int, int]], batch_size: int, max_drafts: int) -> int:
    """vLLM's ``num_speculative_tokens_per_batch_size``: the draft length for a batch size.

    schedule: ``(first, last, k)`` ranges of batch sizes, sorted, the first
    starting at 1 (``SpeculativeConfig`` checks this). A batch size in a gap
    keeps the range before it, and one past the last range keeps the last.
    """
    cap = schedule[0][2]
    for first, _last, k in schedule:
        if batch_size < first:
            break
        cap = k
    return min(cap, max_drafts)
