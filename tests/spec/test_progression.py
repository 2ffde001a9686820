"""Progression drafts: repeating structures whose numbers count (numbered lists, dates) are
continued with the next numbers; plain repeats and text without a period give no draft."""
import pytest

from agentrt.spec.drafters import DraftRequest, SuffixDrafter
from agentrt.spec.drafters.progression import ProgressionConfig, digit_tokens, progression_draft

# A character tokenizer that spells digits one per token: '0'..'9' -> 0..9, others -> 100 + ord.
DIGITS = {d: d for d in range(10)}


def enc(text: str) -> list[int]:
    return [int(c) if c.isdigit() else 100 + ord(c) for c in text]


def dec(ids: list[int]) -> str:
    return "".join(str(i) if i < 10 else chr(i - 100) for i in ids)


def draft_text(context: str, max_k: int = 40, **cfg) -> str:
    return dec(progression_draft(enc(context), DIGITS, max_k, ProgressionConfig(**cfg)).tokens)


def test_numbered_list_counts_on():
    assert draft_text("Plan:\n1. walk\n2. walk\n3. walk\n", max_k=16) == "4. walk\n5. walk\n"


def test_dates_keep_zero_padding_and_carry():
    text = draft_text("Dates: 2025-12-07, 2025-12-08, 2025-12-09, ", max_k=22)
    assert text == "2025-12-10, 2025-12-11"


def test_number_being_written_is_completed():
    # "1" is the start of "10": the draft finishes it and goes on
    assert draft_text("7. go\n8. go\n9. go\n1", max_k=12) == "0. go\n11. go"


def test_number_being_written_that_cannot_be_the_next_one_gives_nothing():
    assert draft_text("7. go\n8. go\n9. go\n5", max_k=12) == ""


def test_steps_other_than_one_and_several_counters():
    assert draft_text("id 10 row 3; id 20 row 4; id 30 row 5; ", max_k=11) == "id 40 row 6"


def test_plain_repeat_and_no_period_give_no_draft():
    assert draft_text("2 days in Rome\n2 days in Rome\n2 days in Rome\n") == ""  # copies: suffix drafter's job
    assert draft_text("The answer is 42 and the year was 1999.") == ""
    assert draft_text("no digits at all, none at all, none at all, ") == ""


def test_structure_seen_once_is_drafted_with_less_confidence():
    cfg = ProgressionConfig()
    once = progression_draft(enc("x\n1. a\n2. a\n"), DIGITS, 4, cfg)
    twice = progression_draft(enc("1. a\n2. a\n3. a\n4. a\n"), DIGITS, 4, cfg)
    assert dec(once.tokens) == "3. a" and dec(twice.tokens) == "5. a"
    # one step seen (2 - 1) is unconfirmed; after two equal steps the count is trusted
    assert once.confidence[0] == cfg.unconfirmed_step_confidence
    assert twice.confidence == [cfg.repeat_confidence] * 4


@pytest.mark.parametrize("max_k", [0, 1, 3, 7])
def test_drafts_never_exceed_max_k(max_k):
    d = progression_draft(enc("1. a\n2. a\n3. a\n"), DIGITS, max_k)
    assert len(d.tokens) == len(d.confidence) <= max_k


def test_digit_tokens_needs_one_digit_per_token():
    assert digit_tokens(enc) == DIGITS

    def grouped(text: str) -> list[int]:  # spells numbers in digit pairs, like some BPE tokenizers
        return [int(text[i : i + 2]) + 1000 for i in range(0, len(text), 2)]

    assert digit_tokens(grouped) is None


def test_suffix_drafter_prefers_the_count_over_copies():
    prompt = enc("Steps:\n")
    out = enc("1. stir\n2. stir\n3. stir\n")
    plain, counting = SuffixDrafter(), SuffixDrafter(digits=DIGITS)
    for d in (plain, counting):
        d.start(0, prompt)
        d.on_verified(0, len(out) - 1, out)
    ctx = prompt + out
    copy = dec(plain.propose([DraftRequest(0, ctx, 8)])[0].tokens)
    count = dec(counting.propose([DraftRequest(0, ctx, 8)])[0].tokens)
    assert count == "4. stir\n"
    assert copy != count and copy.startswith(("1", "2", "3"))
    # the template drafter's path (pending tokens not yet in the request's text) counts too
    pending = enc("4. stir\n")
    assert dec(counting.propose_after(0, pending, 3).tokens) == "5. "
