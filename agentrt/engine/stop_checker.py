"""Apply one request's emitted tokens one at a time, exactly as plain decoding would: the first
stop token, stop string or max_tokens ends the output, and later tokens of the same accepted
draft run are dropped."""
from __future__ import annotations

from agentrt.engine.sequence import Sequence
from agentrt.engine.tokenizer import IncrementalDetokenizer


class StopChecker:
    def __init__(self, seq: Sequence, eos_ids: tuple[int, ...], detok: IncrementalDetokenizer):
        self.seq = seq
        p = seq.params
        self.stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
        self.detok = detok
        self.text = ""  # visible output text (stop strings cut)
        self._held = ""  # text that could still be the start of a stop string
        self._max_stop = max((len(s) for s in p.stop), default=0)

    def apply(self, tokens: list[int]) -> tuple[list[int], str, str | None]:
        """Append tokens in order until one finishes the request. Returns (tokens kept, new
        visible text, finish reason or None)."""
        seq, p = self.seq, self.seq.params
        kept: list[int] = []
        new_text = ""
        for t in tokens:
            seq.output_ids.append(t)
            kept.append(t)
            if t in self.stop_ids:
                return kept, new_text + self.flush(), "stop"
            piece = self.detok.push(t)
            if p.stop:
                buf = self._held + piece
                hit = min(((buf.find(s), s) for s in p.stop if s in buf), default=None)
                if hit is not None:
                    new_text += buf[: hit[0]]
                    self.text += buf[: hit[0]]
                    self._held = ""
                    return kept, new_text, "stop"
                # Hold back a tail that may be the beginning of a stop string.
                keep = self._max_stop - 1
                emit, self._held = (buf[:-keep], buf[-keep:]) if keep and len(buf) > keep else ((buf, "") if not keep else ("", buf))
                new_text += emit
                self.text += emit
            else:
                new_text += piece
                self.text += piece
            if len(seq.output_ids) >= p.max_tokens:
                return kept, new_text + self.flush(), "length"
        return kept, new_text, None

    def flush(self) -> str:
        """Text held back for stop strings, now given out (the request ends without one)."""
        out, self._held = self._held, ""
        self.text += out
        return out
