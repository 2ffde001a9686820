"""The runtime: runs agent programs (agentrt.dag) concurrently against one LLM backend and an
in-process tool registry, and records every node's phases as a trace.

    from agentrt.runtime import EngineBackend, Runtime
    rt = Runtime(EngineBackend(async_engine), tools=[get_weather])
    result = await rt.run(program, {"city": "Oslo"})
    rt.trace.write("runs/trip.jsonl")

Engine-free names import without torch; EngineBackend imports the engine only when used.
"""
from agentrt.runtime.backend import (EngineStep, LLMBackend, LLMRequest, LLMResponse, LLMStepEvent, NodeIdentity,
                                     Usage)
from agentrt.runtime.engine_backend import EngineBackend
from agentrt.runtime.phases import PHASES
from agentrt.runtime.policy import (FCFSPolicy, KVHoldPolicy, LASPolicy, NodeContext, ProgramStats, SchedulingPolicy,
                                    policy_from_name)
from agentrt.runtime.runtime import RunHandle, RunResult, Runtime
from agentrt.runtime.scripted import ScriptedBackend
from agentrt.runtime.trace import Span, Trace, read_trace

__all__ = [
    "PHASES", "EngineBackend", "EngineStep", "FCFSPolicy", "KVHoldPolicy", "LASPolicy", "LLMBackend", "LLMRequest",
    "LLMResponse", "LLMStepEvent", "NodeContext", "NodeIdentity", "ProgramStats", "RunHandle", "RunResult",
    "Runtime", "SchedulingPolicy", "ScriptedBackend", "Span", "Trace", "Usage", "policy_from_name", "read_trace",
]
