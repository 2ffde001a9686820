"""When a failed tool call is tried again: one policy shared by the tool layer (a Tool's own
retries) and the DSL (a node's `p.tool(..., retry=RetryPolicy(...))`), as LangGraph's RetryPolicy.

A leaf module: the DSL and the tool layer both use it and neither imports the other.

Retrying is safe only when a second call cannot repeat an effect the first one had. A tool that
raised may have raised after its write (a payment made, then the confirmation timed out), so for a
tool not declared idempotent the failures to retry must be named (`retry_on`): the exceptions
that mean the call did not take effect (a refused connection, a "try again" from the gateway).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator

# A failure to retry: an exception type (matched with isinstance), a type's name ("ConnectionError"
# or "builtins.ConnectionError": how a tool served by another process names it), or a predicate
# of the exception.
RetryOn = tuple[type[BaseException] | str, ...] | Callable[[BaseException], bool]


@dataclass(frozen=True)
class RetryPolicy:
    """How often, how soon, and on which failures a tool call is tried again.

    max_attempts: attempts in all, the first included (1: never retried). Between attempt n and
    n+1 the call waits min(max_backoff_s, backoff_s * backoff_factor ** (n - 1)). retry_on: the
    failures retried (exception types, their names, or a predicate of the exception); None: every
    failure the tool layer calls retryable (a timeout, an exception the tool raised, an HTTP 5xx,
    no worker online). Bad arguments, an output that breaks the tool's schema and HTTP 4xx answers
    are never retried. A failure matches when the tool layer's error (ToolTimeoutError,
    HttpToolError, ...) or the exception the tool's code raised is one of `retry_on`.

    A field left None is taken from the policy this one is laid over (`over`): a node's policy
    over its tool's, so RetryPolicy(max_attempts=5) only changes the number of attempts.

    >>> p = RetryPolicy(max_attempts=4, backoff_s=0.5, backoff_factor=2, max_backoff_s=1.5)
    >>> [p.backoff(n) for n in (1, 2, 3)]
    [0.5, 1.0, 1.5]
    >>> RetryPolicy(retry_on=ConnectionError).allows(ConnectionRefusedError("no"))
    True
    """

    max_attempts: int | None = None
    backoff_s: float | None = None
    backoff_factor: float | None = None
    max_backoff_s: float | None = None
    retry_on: RetryOn | None = None

    def __post_init__(self) -> None:
        for problem in self._problems():
            raise ValueError(f"RetryPolicy: {problem}")
        if self.retry_on is not None and not _is_predicate(self.retry_on):
            object.__setattr__(self, "retry_on", _as_tuple(self.retry_on))  # hashable, one shape

    def _problems(self) -> Iterator[str]:
        n = self.max_attempts
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            yield f"max_attempts must be an int >= 1 (the first attempt counts), got {n!r}"
        for name, least in (("backoff_s", 0.0), ("backoff_factor", 1.0), ("max_backoff_s", 0.0)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v < least):
                yield f"{name} must be a finite number >= {least:g}, got {v!r}"
        on = self.retry_on
        if on is None or _is_predicate(on):
            return
        items = _as_tuple(on) if isinstance(on, (type, str, tuple, list, set, frozenset)) else None
        if not items or not all(isinstance(t, str) and t or isinstance(t, type) and issubclass(t, BaseException)
                                for t in items):
            yield (f"retry_on must be exception types (e.g. (ConnectionError, TimeoutError)), their names, or a "
                   f"function of the exception answering True to retry, got {on!r}")

    @property
    def retries(self) -> int:
        """Attempts after the first."""
        return (self.max_attempts or 1) - 1

    def over(self, base: RetryPolicy) -> RetryPolicy:
        """This policy with each field it leaves None taken from `base`."""
        return RetryPolicy(**{f.name: getattr(base, f.name) if getattr(self, f.name) is None else getattr(self, f.name)
                              for f in fields(self)})

    def backoff(self, failures: int) -> float:
        """Seconds to wait after the `failures`-th failed attempt."""
        base = 0.0 if self.backoff_s is None else self.backoff_s
        factor = 2.0 if self.backoff_factor is None else self.backoff_factor
        wait = base * factor ** (failures - 1)
        return wait if self.max_backoff_s is None else min(self.max_backoff_s, wait)

    def allows(self, error: BaseException) -> bool:
        """Whether `retry_on` lets this failure be retried (None lets every one)."""
        on = self.retry_on
        if on is None:
            return True
        if _is_predicate(on):
            return bool(on(error))
        names = set(exception_names(error))
        cause = error.__cause__
        if cause is not None:
            names.update(exception_names(cause))
        names.update(getattr(error, "raised", ()))  # what a remote tool's code raised, by name
        return any(isinstance(t, str) and t in names
                   or isinstance(t, type) and (isinstance(error, t) or isinstance(cause, t)) for t in on)

    def describe_retry_on(self) -> str:
        on = self.retry_on
        if on is None:
            return "any retryable failure"
        if _is_predicate(on):
            return getattr(on, "__name__", repr(on))
        return ", ".join(t if isinstance(t, str) else t.__name__ for t in on)


def _is_predicate(on: Any) -> bool:
    return callable(on) and not isinstance(on, type)


def _as_tuple(on: Any) -> tuple[Any, ...]:
    return (on,) if isinstance(on, (type, str)) else tuple(on)


def exception_names(error: BaseException) -> tuple[str, ...]:
    """The names a retry_on entry may give for this exception: each class it is an instance of,
    bare and qualified by module ("ConnectionRefusedError", "builtins.ConnectionError", ...)."""
    out = []
    for cls in type(error).__mro__:
        if cls in (BaseException, object):
            continue
        out += [cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"]
    return tuple(out)


def retry_on_names(on: RetryOn | None) -> list[str] | None:
    """retry_on's types as names ("builtins.ConnectionError"), for a declaration that crosses a
    process boundary; None for None or a predicate (which cannot cross it)."""
    if on is None or _is_predicate(on):
        return None
    return [t if isinstance(t, str) else f"{t.__module__}.{t.__qualname__}" for t in on]


def unsafe_retry(tool: str, idempotent: bool, policy: RetryPolicy, subject: str) -> str | None:
    """Why retrying `tool` under `policy` could repeat its effect, or None: a tool not declared
    idempotent is retried only on the failures the policy names (retry_on). `subject` says where
    the retries were asked for ("tool 'pay': retries=2")."""
    if idempotent or policy.retries == 0 or policy.retry_on is not None:
        return None
    return (f"{subject}, but '{tool}' is not declared idempotent: a failure after its effect (a payment made, "
            f"then a timeout) would make it happen twice. Name the failures that mean the call did not take "
            f"effect with retry_on=(ConnectionRefusedError, ...), declare the tool idempotent=True if a second "
            f"call is harmless, or drop the retries")
