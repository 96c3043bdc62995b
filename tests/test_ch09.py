"""The chapter 9 walkthrough: every step it shows adds up, and the greedy texts match.

On a tiny random model the n-gram search finds nothing to copy, so the first
test gives the proposer drafts taken from the model's own greedy answer, with
d_1 spoiled at one length in three: accepted, rejected, bonus and
recovered tokens then occur at known steps, and every number the walkthrough
prints can be checked exactly. The second test runs it as a learner would, on
SmolLM2 with the real n-gram proposer.
"""

from __future__ import annotations

import argparse
import itertools
import re
from collections.abc import Sequence

import pytest

from chapters import ch09_spec_decode
from chapters._common import console
from chapters.i18n import chinese_heading
from nanoengine import LLM, SamplingParams
from nanoengine.spec_decode.ngram_proposer import NgramProposer

MAX_TOKENS = 16


def _check_every_step_adds_up(result: ch09_spec_decode.Ch09Result) -> None:
    """What each row of section 1 claims, against the others and against section 3."""
    steps = result.steps
    assert steps[0].is_prefill and steps[0].num_computed_after == steps[0].num_scheduled
    for before, after in itertools.pairwise(steps):
        assert after.num_computed_before == before.num_computed_after  # the next step starts at the roll-back
    for s in steps[1:]:
        assert s.num_scheduled == 1 + len(s.drafts)  # the last known token, then every draft
        assert s.num_accepted + s.num_rejected == len(s.drafts)
        assert len(s.sampled) == s.num_accepted + 1  # kept drafts, then the bonus or recovered token
        assert s.sampled[: s.num_accepted] == s.drafts[: s.num_accepted]
        assert s.num_computed_booked == s.num_computed_before + s.num_scheduled  # schedule() counts all
        assert s.num_computed_after == s.num_computed_booked - s.num_rejected  # the roll-back
    # The answer is what the rows append; only the last step can verify past its end.
    assert sum(s.num_appended for s in steps) == len(result.output_token_ids)
    assert all(s.num_appended == len(s.sampled) for s in steps[:-1])
    verified = [s for s in steps if s.drafts]
    stats = result.stats
    assert stats.num_drafts == len(verified)
    assert stats.num_draft_tokens == sum(len(s.drafts) for s in verified)
    assert stats.num_accepted_tokens == sum(s.num_accepted for s in verified)
    for position in range(stats.num_spec_tokens):
        assert stats.num_draft_tokens_per_pos[position] == sum(len(s.drafts) > position for s in verified)
        assert stats.num_accepted_tokens_per_pos[position] == sum(s.num_accepted > position for s in verified)


def _check_the_rejection_view(result: ch09_spec_decode.Ch09Result) -> None:
    view = result.rejection
    assert view is not None
    record = result.steps[view.step]
    assert record.num_rejected > 0 and view.step == min(s.step for s in result.steps if s.num_rejected)
    fates = [slot.fate for slot in view.slots]
    assert fates == ["verified"] * (record.num_accepted + 1) + ["rejected draft"] * record.num_rejected
    assert [slot.position for slot in view.slots] == list(range(record.num_computed_before,
                                                                record.num_computed_booked))
    assert not set(view.cached_block_ids) & set(view.draft_block_ids)  # no block holding a draft was cached
    # The next step wrote the recovered token over the first rejected slot; the kept ones stayed.
    assert view.rewrites is not None and view.next_step_seq_len is not None
    first = view.rewrites[0]
    assert first.position == record.num_computed_after and first.new_token == record.sampled[-1]
    assert first.new_token != first.old_token and first.k_changed
    assert all(rewrite.as_expected for rewrite in view.rewrites), view.rewrites
    assert all((r.new_token is None) == (r.position >= view.next_step_seq_len) for r in view.rewrites)
    assert view.verified_unchanged is True


def test_ch09_on_a_tiny_model_with_drafts_that_are_right_or_spoiled(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The tokens the engine writes without speculation: what a perfect proposer would guess.
    plain = LLM(tiny_llama, **ch09_spec_decode.engine_kwargs(_args()))
    rendered = plain.llm_engine.renderer.render_chat([{"role": "user", "content": ch09_spec_decode.BY_HAND_PROMPT}])
    # A few tokens more than the walkthrough writes, so that every draft has its reference.
    answer = plain.chat([{"role": "user", "content": ch09_spec_decode.BY_HAND_PROMPT}],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS + 8), use_tqdm=False)
    answer_ids = list(answer[0].outputs[0].token_ids)
    reference = rendered["prompt_token_ids"] + answer_ids
    plain.llm_engine.shutdown()
    spoiled_at: set[int] = set()  # lengths at which d_1 was spoiled

    def propose(self: NgramProposer, token_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        drafts: list[list[int]] = []
        for tokens in token_ids:
            n = len(tokens)
            if list(tokens) != reference[:n] or n >= len(reference):
                drafts.append([])  # another prompt (section 4), or the answer's end
                continue
            draft = reference[n : n + self.k]
            # Spoil at one length in three: as a step adds 2 tokens after a
            # spoiled draft and k + 1 = 4 after a right one, both kinds follow.
            if len(draft) >= 2 and n % 3 == 0:
                draft[1] = (draft[1] + 1) % 300  # any other token: the target cannot agree
                spoiled_at.add(n)
            drafts.append(draft)
        return drafts

    monkeypatch.setattr(NgramProposer, "propose", propose)
    try:
        result = ch09_spec_decode.main(
            ["--model", tiny_llama, "--max-tokens", str(MAX_TOKENS), "--repeats", "1", "--lang", "zh"]
        )
    finally:
        console.language = "en"
    assert spoiled_at, "the fake proposer was never asked"
    _check_every_step_adds_up(result)
    verified = [s for s in result.steps if s.drafts]
    assert len(verified) >= 2
    for s in verified:
        n = s.num_computed_before + 1  # known tokens when the proposer drafted
        if n in spoiled_at:  # d_0 is right, d_1 spoiled: 1 accepted, the rest rejected
            assert (s.num_accepted, s.num_rejected) == (1, len(s.drafts) - 1)
            assert s.sampled[-1] == reference[n + 1]  # the recovered token is the target's own choice
        else:
            assert (s.num_accepted, s.num_rejected) == (len(s.drafts), 0)
            assert s.sampled[-1] == reference[n + len(s.drafts)]  # the bonus token
    assert any(s.num_rejected for s in verified) and any(not s.num_rejected for s in verified)
    _check_the_rejection_view(result)
    assert result.output_token_ids == answer_ids[:MAX_TOKENS]  # what the engine writes without speculation
    speed = result.speed
    assert speed is not None and speed.same_text
    # The copied answer verified drafts; the batch still takes as many steps as its slowest
    # request, and the other prompts find nothing to copy from a random model.
    assert speed.mean_acceptance_length is not None and speed.mean_acceptance_length > 1
    printed = capsys.readouterr().out
    out = " ".join(printed.split())  # rich wraps long lines at spaces: undo it
    # The introduction is printed in a panel, wrapped at any character: compare without borders or breaks.
    assert "第9章：投机解码" in re.sub(r"[\s│╭╮╰╯─]", "", printed)
    for heading in ("1. One request, step by step: drafts, verdicts, the roll-back", "2. The KV blocks around a rejection"):
        chinese = chinese_heading(heading)
        assert chinese is not None and chinese in out, heading
    assert "(recovered)" in out and "(bonus)" in out and "✓ ✗" in out
    assert "of those, cached: none" in out and "Verified slots unchanged: True" in out
    assert "CPU: " in out and "flags: " in out
    assert "greedy texts identical with and without speculation: True" in out


@pytest.mark.slow
def test_ch09_on_smollm2_with_the_real_ngram_proposer(
    default_model_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = ch09_spec_decode.main(["--model", default_model_path, "--max-tokens", "32", "--repeats", "1"])
    _check_every_step_adds_up(result)
    assert result.text.startswith("The quick brown fox jumps over the lazy dog.")
    stats = result.stats
    assert stats.mean_acceptance_length is not None and stats.mean_acceptance_length > 2.5
    assert len(result.steps) < 32 / 2  # most steps emit several tokens
    _check_the_rejection_view(result)
    speed = result.speed
    assert speed is not None and speed.same_text and speed.steps["ngram"] < speed.steps["plain"]
    out = " ".join(capsys.readouterr().out.split())
    assert "1. One request, step by step" in out and "(recovered)" in out and "(bonus)" in out
    assert "greedy texts identical with and without speculation: True" in out
    assert "ngram / plain: " in out and "x tokens/s" in out


def _args() -> argparse.Namespace:
    """The walkthrough's defaults, for a plain engine built the same way."""
    return argparse.Namespace(dtype="float32", block_size=16)
