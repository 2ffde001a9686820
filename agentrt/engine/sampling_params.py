"""What a request asks of the sampler. Validated on arrival; a bad value names the field."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from agentrt.errors import RequestError

# Past ~10 the processed p is near uniform over the vocabulary: random tokens, not a setting
# anyone means (OpenAI caps temperature at 2).
MAX_TEMPERATURE = 100.0


def _real(x: object) -> bool:
    """A finite int or float (not a bool, not a numeric string)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # per-request generator; None draws one from the engine's
    stop: tuple[str, ...] = ()  # stop strings; the output ends before the first one
    stop_token_ids: tuple[int, ...] = ()  # besides the model's end-of-sequence tokens
    ignore_eos: bool = False
    response_format: dict | None = field(default=None, compare=False)  # structured output (OpenAI style)
    # what was generated steers what comes next (agentrt.decoding.penalties: exact under speculation)
    frequency_penalty: float = 0.0  # OpenAI: minus this x the token's count in the output, [-2, 2]
    presence_penalty: float = 0.0  # OpenAI: minus this once a token is in the output, [-2, 2]
    repetition_penalty: float = 1.0  # HF/vLLM: divides (multiplies) positive (negative) logits of seen tokens
    min_tokens: int = 0  # no end-of-sequence or stop token before this many generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a dict is accepted
    # per generated token its log-probability under the model (raw logits: before penalties,
    # temperature and grammar masks, as vLLM reports them) and this many top alternatives (0-20)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        stop = self.stop
        if isinstance(stop, str):
            if not stop:
                raise RequestError("stop: a stop string must not be empty (it would end the output at once)")
            object.__setattr__(self, "stop", (stop,))
        elif isinstance(stop, (list, tuple)):
            bad = [s for s in stop if not isinstance(s, str) or not s]
            if bad:
                raise RequestError(f"stop: every stop must be a non-empty string, got {bad[0]!r}")
            object.__setattr__(self, "stop", tuple(stop))
        elif stop is None:
            object.__setattr__(self, "stop", ())
        else:
            raise RequestError(f"stop: expected a string or a list of strings, got {type(stop).__name__}")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise RequestError(f"stop_token_ids: expected a list of token ids, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _real(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise RequestError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**63):
            raise RequestError(f"seed must be None or an integer in [0, 2**63), got {self.seed!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and -2.0 <= v <= 2.0):
                raise RequestError(f"{name} must be a number in [-2, 2], got {v!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and 0 < self.repetition_penalty <= 10):
            raise RequestError(f"repetition_penalty must be in (0, 10] (1 = off), got {self.repetition_penalty!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= 20):
            raise RequestError(f"logprobs must be None or an integer in [0, 20], got {self.logprobs!r}")
        bias = self.logit_bias
        pairs = list(bias.items()) if isinstance(bias, dict) else list(bias or ())
        try:
            pairs = [(int(t), float(b)) for t, b in pairs]
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias: expected token id -> bias, got {bias!r}") from None
        bad = [(t, b) for t, b in pairs if t < 0 or not -100 <= b <= 100]
        if bad:
            raise RequestError(f"logit_bias: token ids must be >= 0 and biases in [-100, 100], got {bad[0]}")
        object.__setattr__(self, "logit_bias", tuple(sorted(dict(pairs).items())))
