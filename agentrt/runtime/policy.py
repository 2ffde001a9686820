"""Scheduling policies: the engine priority of each LLM request (smaller = sooner), and how long a
program's KV is held while it waits on tools.

The runtime keeps, per program run, the service it has attained (engine tokens and a fair share
of engine time, per LLM node too, tool time) and the critical path left; a policy reads them when
an LLM node is submitted (`priority`) and after each node ends (`reprioritize`, applied to that
program's requests in flight). A policy with `dynamic = True` is also asked again after every
engine step an LLM node takes part in, and changed priorities go to the engine at once.

    fcfs  every request at priority 0: the engine's arrival order decides (a call-level engine).
    las   least attained service per program (Autellix's PLAS), measured along the heaviest
          completed path into the node for fan-out programs (like Autellix's ATLAS); among equal
          service, nodes on their program's critical path before branches with slack. See LASPolicy.

`KVHoldPolicy` sizes the time-to-live of the KV pins the runtime places when an LLM call ends in a
tool call: a per-tool estimate of the p90 latency, learnt online.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

from agentrt.errors import RunConfigError


@dataclass
class ProgramStats:
    """What a program run has received so far. llm_service_s: each engine step's duration split
    evenly over the requests in its batch; llm_tokens: tokens the engine processed for it
    (prompt fed + drafts verified); node_service_s / node_tokens: the same per LLM node;
    critical_path: calls left on its longest path. cached_tokens: prompt tokens the engine took
    from its prefix cache (prefill saved). kv_holds: KV pins placed while waiting on a tool;
    their outcome at the program's next LLM call: hit (the held prefix was reused), miss (it had
    been evicted) or unused (the next call does not continue the held prompt)."""

    run_id: str
    program: str
    started: float
    llm_tokens: int = 0
    llm_service_s: float = 0.0
    tool_s: float = 0.0
    llm_calls: int = 0
    tool_calls: int = 0
    critical_path: float = 0.0
    llm_in_flight: int = 0
    tools_in_flight: int = 0
    cached_tokens: int = 0
    kv_holds: int = 0
    kv_held_blocks: int = 0
    kv_hold_hits: int = 0
    kv_hold_misses: int = 0
    kv_hold_unused: int = 0
    prefill_ahead_tokens: int = 0  # prompt tokens computed while the program waited on tools
    node_service_s: dict[str, float] = field(default_factory=dict)
    node_tokens: dict[str, int] = field(default_factory=dict)

    def to_record(self) -> dict[str, float | int]:
        return {"llm_tokens": self.llm_tokens, "llm_service_s": round(self.llm_service_s, 6),
                "tool_s": round(self.tool_s, 6), "llm_calls": self.llm_calls, "tool_calls": self.tool_calls,
                "prefill_saved_tokens": self.cached_tokens, "kv_holds": self.kv_holds,
                "kv_held_blocks": self.kv_held_blocks, "kv_hold_hits": self.kv_hold_hits,
                "kv_hold_misses": self.kv_hold_misses, "kv_hold_unused": self.kv_hold_unused,
                "prefill_ahead_tokens": self.prefill_ahead_tokens}


@dataclass(frozen=True)
class NodeContext:
    """An LLM node about to be submitted. critical_path: the longest path of calls left from this
    node (itself included). next_is_tool: a tool call follows it (its KV could be held).
    path_service_s / path_tokens: LLM service attained along the heaviest path of finished
    nodes leading into this one (for a chain, everything the program received before it; for a
    fan-out branch, its own ancestry, not its siblings')."""

    run_id: str
    node: str
    critical_path: float
    next_is_tool: bool
    path_service_s: float = 0.0
    path_tokens: int = 0


class SchedulingPolicy(Protocol):
    def priority(self, program: ProgramStats, node: NodeContext) -> float:
        """The engine priority of a new LLM request of `program`."""
        ...

    def reprioritize(self, programs: Sequence[ProgramStats]) -> Mapping[str, float]:
        """New priorities by run_id for requests already in flight ({}: no change)."""
        ...


class FCFSPolicy:
    """First come, first served: every request at priority 0."""

    name = "fcfs"
    dynamic = False

    def priority(self, program: ProgramStats, node: NodeContext) -> float:
        return 0.0

    def reprioritize(self, programs: Sequence[ProgramStats]) -> Mapping[str, float]:
        return {}


class LASPolicy:
    """Least attained service, per program (Autellix's PLAS), with critical-path awareness.

    Attained service S of a node's request: by default ("seconds") the engine time the program
    has received, each step's duration split evenly over its batch. Time rather than tokens
    because time is what programs compete for: a prompt token costs a fraction of a decoded one
    (on 2 CPU cores a 600-token prefill step takes the time of ~25-50 decode steps, not 600; on
    a GPU a few), and verified drafts cost less than emitted tokens; token counts would rank a
    program with a long prompt far behind one that decoded as long. unit="tokens" (prompt fed +
    drafts) is there for machines where step times are too noisy to compare.

    With critical_path=True (default), S is measured along the heaviest path of finished nodes
    into the node plus what the node itself has received so far (ATLAS-like): a fan-out branch
    is charged for its ancestry, not for its siblings running beside it, so a program is not
    pushed back for its parallelism. For a chain this is the program's whole service.

    S is bucketed into geometric levels (Autellix's multi-level queues, MLFQ-like): level 0 below
    `quantum`, then one level per doubling. Within a level, critical-path awareness: a node on
    its program's critical path goes before a node with slack, i.e. a fan-out branch that can
    wait without delaying its program's end (the program's longest path runs elsewhere):

        priority = level(S) + slack / (1 + slack)
        level(S) = 0 if S < q else 1 + floor(log2(S / q))
        slack    = program.critical_path - node.critical_path   (calls left; >= 0)

    The fraction lies in [0, 1), so it never crosses levels. Slack and not the critical path
    itself: ranking whole programs by work left would run the longest first, against what LAS
    (like SRPT) wants for mean completion time; slack only reorders within a program's branches.
    Equal level and slack: the engine's arrival order. New programs (S = 0) go first; a
    program's priority only drops as it is served, so a long program waits behind fresh ones, as
    in LAS, and is never starved by a program that has received more. The policy is dynamic: the
    runtime re-evaluates a request's priority after each of its engine steps, so a long call
    drops a level while it decodes.
    """

    name = "las"
    dynamic = True

    def __init__(self, unit: str = "seconds", quantum: float | None = None, critical_path: bool = True) -> None:
        if unit not in ("seconds", "tokens"):
            raise RunConfigError(f"LASPolicy unit must be 'seconds' or 'tokens', got {unit!r}")
        q = quantum if quantum is not None else (0.02 if unit == "seconds" else 32.0)
        if not (isinstance(q, (int, float)) and q > 0):
            raise RunConfigError(f"LASPolicy quantum must be > 0, got {quantum!r}")
        self.unit, self.quantum, self.critical_path = unit, float(q), critical_path

    def attained(self, program: ProgramStats, node: NodeContext) -> float:
        if self.unit == "seconds":
            if not self.critical_path:
                return program.llm_service_s
            return node.path_service_s + program.node_service_s.get(node.node, 0.0)
        if not self.critical_path:
            return float(program.llm_tokens)
        return float(node.path_tokens + program.node_tokens.get(node.node, 0))

    def level(self, service: float) -> int:
        return 0 if service < self.quantum else 1 + int(math.floor(math.log2(service / self.quantum)))

    def priority(self, program: ProgramStats, node: NodeContext) -> float:
        slack = max(0.0, program.critical_path - node.critical_path)
        return self.level(self.attained(program, node)) + slack / (1.0 + slack)

    def reprioritize(self, programs: Sequence[ProgramStats]) -> Mapping[str, float]:
        return {}  # per node, after each engine step (dynamic)


POLICIES = {"fcfs": FCFSPolicy, "las": LASPolicy}


def policy_from_name(name: str) -> SchedulingPolicy:
    """'fcfs' or 'las' (least attained service with critical-path awareness)."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise RunConfigError(f"unknown scheduling policy {name!r}; choose one of {', '.join(POLICIES)}") from None


@dataclass
class _LogLatency:
    """Exponentially weighted mean and variance of log latency (tool latencies are heavy-tailed:
    their logs are closer to normal than the seconds themselves)."""

    mean: float
    var: float
    count: int = 1


class KVHoldPolicy:
    """How long to hold a finished call's KV while its program waits on tools.

    Per tool, an EWMA (weight `weight`) of the mean and variance of log latency, the variance
    starting at prior_log_sd² so that one observation does not claim a tight tail. A tool's
    hold estimate is its log-normal p`quantile` (exp(mean + z·sd)); for a wait through several
    tools the runtime adds the estimates of consecutive tools (max over parallel ones). Before a
    tool was seen: default_s. ttl = estimate + margin_s (the next call's queueing), capped at
    max_s. Pins are only a preference: the engine hands pinned blocks out last, earliest expiry
    first, so a wrong estimate costs reuse, never correctness."""

    def __init__(self, default_s: float = 2.0, margin_s: float = 0.5, quantile: float = 0.9, weight: float = 0.2,
                 prior_log_sd: float = 1.0, max_s: float = 60.0) -> None:
        if not 0.5 <= quantile < 1.0 or not 0.0 < weight <= 1.0:
            raise RunConfigError(f"KVHoldPolicy needs 0.5 <= quantile < 1 and 0 < weight <= 1, "
                                 f"got {quantile}, {weight}")
        if min(default_s, margin_s, prior_log_sd) < 0 or max_s <= 0:
            raise RunConfigError("KVHoldPolicy: default_s, margin_s and prior_log_sd must be >= 0, max_s > 0")
        from statistics import NormalDist

        self.default_s, self.margin_s, self.max_s = default_s, margin_s, max_s
        self.weight, self.prior_var = weight, prior_log_sd ** 2
        self.z = NormalDist().inv_cdf(quantile)
        self._tools: dict[str, _LogLatency] = {}

    def observe(self, tool: str, seconds: float) -> None:
        x = math.log(max(seconds, 1e-4))
        est = self._tools.get(tool)
        if est is None:
            self._tools[tool] = _LogLatency(x, self.prior_var)
            return
        d = x - est.mean
        est.mean += self.weight * d
        est.var = (1 - self.weight) * (est.var + self.weight * d * d)
        est.count += 1

    def estimate(self, tool: str) -> float:
        """The tool's latency quantile in seconds (default_s before it was observed)."""
        est = self._tools.get(tool)
        if est is None:
            return self.default_s
        return math.exp(est.mean + self.z * math.sqrt(est.var))

    def ttl(self, stall_s: float) -> float:
        """The pin's time-to-live for an expected stall of stall_s seconds."""
        return min(self.max_s, stall_s + self.margin_s)

    def known(self) -> dict[str, float]:
        return {t: round(self.estimate(t), 4) for t in self._tools}
