"""Agent programs as graphs of LLM calls, tool calls and waits for outside input: the DSL, the
graph IR and its run-time expansion. Imports nothing from agentrt but its leaves (agentrt.errors,
agentrt.retry): no torch, no engine, no runtime.

    p = Program("trip", inputs={"request": str}, tools=[get_weather, ...])
    plan = p.llm("plan", prompt="Plan: {request}", output=JsonSchema({...}))
    weather = p.tool("weather", "get_weather", args={"city": plan["city"]}, fallback=None)
    p.output(p.llm("summary", prompt="Summarise {plan} with {weather}"))
    program = p.compile()          # CompiledProgram: frozen networkx DiGraph + scheduler queries
    run = program.start({"request": "..."})   # ProgramRun: the runtime drives it
"""
from agentrt.dag.analysis import CallCount
from agentrt.dag.builder import Program, Scope
from agentrt.dag.compiled import CompiledProgram
from agentrt.dag.outputs import JsonSchema, OutputSpec, Text, ToolCall
from agentrt.dag.refs import Ref, Template, resolve
from agentrt.dag.render import render_prompt, tool_arguments
from agentrt.dag.run import ProgramRun
from agentrt.dag.specs import (AgentLoopSpec, BranchSpec, Case, Constant, FanOutSpec, InputSpec, ItemSpec, LLMSpec,
                               NodeSpec, ToolSpec, WaitForSpec)
from agentrt.dag.tooldefs import ToolDef
from agentrt.retry import RetryPolicy

__all__ = [
    "AgentLoopSpec", "BranchSpec", "CallCount", "Case", "CompiledProgram", "Constant", "FanOutSpec", "InputSpec",
    "ItemSpec", "JsonSchema", "LLMSpec", "NodeSpec", "OutputSpec", "Program", "ProgramRun", "Ref", "RetryPolicy",
    "Scope", "Template", "Text", "ToolCall", "ToolDef", "ToolSpec", "WaitForSpec", "render_prompt", "resolve",
    "tool_arguments",
]
