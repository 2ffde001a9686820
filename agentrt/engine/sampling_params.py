"""What a request asks of the sampler. Validated on arrival; a bad value names the field."""
from __future__ import annotations

from dataclasses import dataclass, field

from agentrt.errors import RequestError


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

    def __post_init__(self) -> None:
        stop = self.stop
        if isinstance(stop, str):
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
        if not (self.temperature >= 0):
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
