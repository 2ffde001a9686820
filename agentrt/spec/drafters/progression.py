"""Progression drafts: text that repeats with its numbers counting (numbered lists, dates, ids).

A copy drafter (suffix.py) continues a repeating structure with the numbers it saw the last time
round: after "4. 2 days in Lisbon\\n5. 2 days in Lisbon\\n" it drafts "5." where the model writes
"6.", and loses the rest of the line at that token. Here the text is read as items, a number
(a maximal run of digit tokens) or any other token, and matched against itself one period back
with every number standing for a slot. If the last `period` items agree with the period before,
the draft continues the structure and fills each number slot by its arithmetic progression:

    value = v[j - q] + (v[j - q] - v[j - 2q])      (q: the period in items)

with the source's zero padding ("2025-12-09, 2025-12-10"). A slot whose step was the same the
period before ("confirmed") is drafted with the structure's confidence, a step seen once with
less. Nothing here changes what is emitted: drafts are verified against the target like any
others, so a wrong guess costs acceptance, never correctness.

Needs a tokenizer that spells numbers one digit per token (SmolLM2, Llama 2, Mistral, Qwen);
`digit_tokens` finds out. Pure Python ints; no torch.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agentrt.spec.drafters.base import Draft

NUM = -1  # skeleton key of a number item


@dataclass(frozen=True)
class ProgressionConfig:
    window: int = 192  # context tokens read
    max_period: int = 40  # longest period, in items
    min_agree: int = 4  # fewest items that must agree with one period back (and never under a period)
    repeat_confidence: float = 0.9  # per token once the structure has repeated twice or more
    first_repeat_confidence: float = 0.6  # the structure has repeated once
    unconfirmed_step_confidence: float = 0.5  # a number whose step was seen once


def digit_tokens(encode: Callable[[str], list[int]]) -> dict[int, int] | None:
    """token id -> digit for a tokenizer that writes every number one digit per token, else None."""
    ids = {}
    for d in range(10):
        toks = encode(str(d))
        if len(toks) != 1:
            return None
        ids[toks[0]] = d
    by_digit = {d: t for t, d in ids.items()}
    probe = "90817263544536271809"
    if len(ids) != 10 or encode(probe) != [by_digit[int(c)] for c in probe]:
        return None
    return ids


@dataclass
class _Items:
    keys: list[int]  # token id, or NUM
    values: list[int]  # the number (NUM items), else 0
    widths: list[int]  # digits written, for zero padding (0: not zero-padded)


def _parse(tokens: Sequence[int], digits: dict[int, int]) -> tuple[_Items, str]:
    """Items of tokens, and the digits of a number the text ends in ('' if it ends otherwise):
    that number may go on, so it is not an item yet."""
    items = _Items([], [], [])
    run = ""
    for t in tokens:
        d = digits.get(t)
        if d is not None:
            run += str(d)
            continue
        if run:
            _add_number(items, run)
            run = ""
        items.keys.append(t)
        items.values.append(0)
        items.widths.append(0)
    return items, run


def _add_number(items: _Items, run: str) -> None:
    items.keys.append(NUM)
    items.values.append(int(run))
    items.widths.append(len(run) if len(run) > 1 and run[0] == "0" else 0)


def _period(keys: list[int], partial: bool, cfg: ProgressionConfig) -> tuple[int, int]:
    """Smallest period q (items) whose last q items, and the partial number if any, equal the q
    before them; returns (q, how many items agree back from the end) or (0, 0)."""
    m = len(keys)
    for q in range(2, min(cfg.max_period, m // 2) + 1):
        if partial and keys[m - q] != NUM:  # the number being written sits at slot m, source m - q
            continue
        agree = 0
        while agree < m - q and keys[m - 1 - agree] == keys[m - 1 - agree - q]:
            agree += 1
        if agree >= max(q, cfg.min_agree) and NUM in keys[m - q:]:
            return q, agree
    return 0, 0


def progression_draft(tokens: Sequence[int], digits: dict[int, int], max_k: int,
                      cfg: ProgressionConfig = ProgressionConfig()) -> Draft:
    """The continuation of a repeating structure whose numbers count; empty unless at least one
    drafted number steps (a plain repeat is the copy drafter's job)."""
    if max_k <= 0 or not digits:
        return Draft.empty()
    tail = tokens[-cfg.window:]
    if not any(t in digits for t in tail[-2 * cfg.max_period:]):
        return Draft.empty()
    items, partial = _parse(tail, digits)
    q, agree = _period(items.keys, bool(partial), cfg)
    if q == 0:
        return Draft.empty()
    spell = {d: t for t, d in digits.items()}
    keys, values, widths = items.keys, items.values, items.widths
    structure_conf = cfg.repeat_confidence if agree >= 2 * q else cfg.first_repeat_confidence
    tokens_out: list[int] = []
    confidence: list[float] = []
    counted = False
    start = j = len(keys)  # items drafted are appended, so later slots can follow them
    while len(tokens_out) < max_k and j - start < 2 * q:
        src = j - q
        if keys[src] != NUM:
            keys.append(keys[src])
            values.append(0)
            widths.append(0)
            tokens_out.append(keys[src])
            confidence.append(structure_conf)
        else:
            step, conf = 0, cfg.unconfirmed_step_confidence
            if src - q >= 0 and keys[src - q] == NUM:
                step = values[src] - values[src - q]
                confirmed = src - 2 * q >= 0 and keys[src - 2 * q] == NUM and \
                    values[src - q] - values[src - 2 * q] == step
                conf = structure_conf if confirmed or step == 0 else cfg.unconfirmed_step_confidence
            value = values[src] + step
            if value < 0:
                break
            text = str(value).zfill(widths[src])
            if j == start and partial:  # the number being written
                if not text.startswith(partial):
                    break
                text = text[len(partial):]
            counted = counted or step != 0
            keys.append(NUM)
            values.append(value)
            widths.append(widths[src])
            for c in text[: max_k - len(tokens_out)]:
                tokens_out.append(spell[int(c)])
                confidence.append(conf)
        j += 1
    if not counted:
        return Draft.empty()
    return Draft(tokens=tokens_out, probs=None, confidence=confidence)
