"""Where RemoteEngineBackend sends a call (see remote_backend.py), by routing mode:
- "affinity" (the default): the engine worker holding its KV while that worker has room, else the
  least-loaded one;
- "round-robin": the online workers in turn, KV and load ignored (the baseline affinity is
  measured against: `agentrt bench scale`);
- "broker": the group's shared subscription, where the MQTT broker hands each call to one of the
  subscribed workers (the caller learns which from its ack); a retry after a lost worker goes to
  a named other worker, so that a broker that has not yet noticed the loss cannot pick it again.
  A prefill-ahead still runs on a named worker (it must know where the KV is); in this mode the
  call it prepares may land elsewhere."""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from agentrt.runtime.backend import LLMRequest
from agentrt.runtime.remote_protocol import RemoteResponse, conversation_hash, prefix_hashes

ROUTING_MODES = ("affinity", "round-robin", "broker")
PLACEMENTS = 4096  # (run, node) -> worker and conversation -> worker entries remembered for affinity


@dataclass
class WorkerState:
    """An online engine worker as its last status message describes it."""

    worker: str
    status: dict[str, Any]
    seen: float  # time.monotonic() of its last status
    in_flight: int = 0  # this backend's calls on it

    @property
    def load(self) -> int:
        return max(self.in_flight, int(self.status.get("running", 0)) + int(self.status.get("waiting", 0)))

    @property
    def kv_free(self) -> int:
        return int((self.status.get("kv") or {}).get("free", 0))

    @property
    def has_room(self) -> bool:
        return self.load < int(self.status.get("max_num_seqs", 1 << 30)) and self.kv_free > 0


class Router:
    """The online workers (their last status) and where recent calls ran."""

    def __init__(self, mode: str = "affinity") -> None:
        if mode not in ROUTING_MODES:
            raise ValueError(f"engine routing {mode!r}: choose one of {', '.join(ROUTING_MODES)}")
        self.mode = mode
        self._turn = 0  # round-robin's next position
        self.workers: dict[str, WorkerState] = {}
        self._placed: collections.OrderedDict[Any, str] = collections.OrderedDict()
        self.affinity_routed = 0  # calls sent to a worker for its KV

    def remember(self, key: Any, worker: str) -> None:
        self._placed[key] = worker
        self._placed.move_to_end(key)
        while len(self._placed) > PLACEMENTS:
            self._placed.popitem(last=False)

    def route(self, request: LLMRequest, avoid: set[str]) -> str | None:
        candidates = {w: s for w, s in self.workers.items() if w not in avoid} or dict(self.workers)
        if not candidates:
            return None
        if self.mode == "round-robin":
            names = sorted(candidates)
            self._turn += 1
            return names[(self._turn - 1) % len(names)]
        wanted = [self._placed.get(("ahead", request.node.run_id, request.node.node))]  # its prefill-ahead's KV
        if request.hints.get("continues"):
            wanted.append(self._placed.get(("node", request.node.run_id, request.hints["continues"])))
        for h in prefix_hashes(request.messages)[1:]:  # the whole conversation is new: its prefixes may not be
            wanted.append(self._placed.get(("conversation", h)))
            wanted += [w for w, s in candidates.items() if h in (s.status.get("prefixes") or ())]
        for w in wanted:
            if w in candidates and candidates[w].has_room:
                self.affinity_routed += 1
                return w
        return min(candidates.values(), key=lambda s: (s.load, -s.kv_free, s.worker)).worker

    def placed_after(self, request: LLMRequest, response: RemoteResponse) -> None:
        self.remember(("node", request.node.run_id, request.node.node), response.worker)
        sent = list(response.sent_messages or request.messages)
        self.remember(("conversation", conversation_hash([*sent, {"role": "assistant", "content": response.text}])),
                       response.worker)
