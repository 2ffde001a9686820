"""bench scale's measuring pieces on a tiny random model: the conversations' prefix reuse counted
from the traces, and the failover of two real replicas on PostgreSQL with their LLM calls on a real
engine worker over mosquitto. Speed is not checked."""
from __future__ import annotations

import asyncio

import pytest

from agentrt.bench import scale, scale_procs


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return str(tiny_model_dir("smollm"))


def test_conversations_count_the_engine_s_prefix_reuse(tiny_model):
    from agentrt.engine import AsyncEngine, EngineConfig, LLMEngine, SpecConfig
    from agentrt.runtime.engine_backend import EngineBackend

    engine = AsyncEngine(LLMEngine(EngineConfig(model=tiny_model, dtype="float32", spec=SpecConfig(drafter="none"),
                                                kv_cache_tokens=8192)))
    backend = EngineBackend(engine)
    try:
        figures = asyncio.run(scale.conversation_load(backend, 2, [0.0, 0.1], 6, seed=1))
    finally:
        backend.close()
        engine.close()
    assert figures["llm_calls"] == 6  # three calls per conversation, each with its usage in the trace
    # the second and third calls continue the first (and all share the system prompt): the engine
    # served part of their prompts from its prefix cache
    assert 0 < figures["cached_tokens"] < figures["prompt_tokens"]
    assert figures["mean_s"] > 0


def test_failover_of_a_killed_replica_to_the_other(tiny_model, postgres_cluster, tmp_path):
    from agentrt.tools.mosquitto import MosquittoBroker

    with MosquittoBroker() as broker:
        workers = scale_procs.EngineWorkers(broker.url, tiny_model, tmp_path, [
            "--dtype", "float32", "--spec", "none", "--kv-cache-tokens", "4096", "--no-prefault-kv", "--no-warm-up",
            "--status-interval", "0.3", "--log-level", "WARNING"])
        workers.start("w1")
        try:
            result = scale_procs.failover_time(tmp_path, postgres_cluster.new_database(), broker.url, "tiny",
                                               lease_s=1.0, runs=2, tool_s=1.5)
        finally:
            workers.stop()
    assert result["statuses"] == ["done", "done"]  # the other replica finished them (its LLM call on the worker)
    assert 0.0 < result["failover_s"] < 1.0 + 5.0  # about the lease: not measured for speed here
