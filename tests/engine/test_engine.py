"""Engine behaviour: batching invariance, preemption, chunked prefill, stops, sampling, bad input."""
from __future__ import annotations

import asyncio

import pytest

from agentrt.engine import AsyncEngine, SamplingParams
from agentrt.errors import RequestError

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
CHATS = [[{"role": "user", "content": c}] for c in (
    "What is the capital of France?", "Write a haiku about the sea.", "Name a prime number.", "Say hello in Spanish.")]


def test_batch_invariance_smollm2(smollm2_fp32, make_engine):
    engine = make_engine(smollm2_fp32)
    alone = engine.generate([CHATS[0]], GREEDY)[0].token_ids
    together = engine.generate(CHATS, GREEDY)[0].token_ids
    assert alone == together


def test_preemption_and_chunked_prefill_keep_greedy_output(tiny_loaded, make_engine):
    loaded = tiny_loaded("smollm")
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [list(range(10 + i, 60 + 7 * i)) for i in range(4)]
    reference = [r.token_ids for r in make_engine(loaded).generate(prompts, params)]
    # 12 blocks of 8 tokens cannot hold four ~100-token sequences: someone must be preempted.
    small = make_engine(loaded, kv_cache_tokens=96 + 8 * 8, block_size=8, max_num_batched_tokens=24)
    got = small.generate(prompts, params)
    assert [r.token_ids for r in got] == reference
    assert sum(r.num_preemptions for r in got) > 0
    assert small.blocks.num_free == small.blocks.allocator.num_blocks  # nothing leaked
    small.blocks.check_invariants()


def test_stop_token_string_and_length(tiny_loaded, make_engine):
    engine = make_engine(tiny_loaded("smollm"))
    base = engine.generate(["hello there"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 30
    # Stop on the 5th generated token: output ends with it, reason "stop".
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    r = engine.generate(["hello there"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=(stop_id,)))[0]
    assert r.finish_reason == "stop" and r.token_ids == base.token_ids[: first + 1]
    # A stop string taken from the middle of the text cuts the text right before it.
    text = base.text
    assert len(text) > 6
    needle = text[3:6]
    r = engine.generate(["hello there"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[needle]))[0]
    assert r.finish_reason == "stop" and r.text == text[: text.find(needle)]


def test_seeded_sampling_is_reproducible(tiny_loaded, make_engine):
    engine = make_engine(tiny_loaded("llama3"))
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    a = engine.generate(["the cat"], p)[0].token_ids
    b = engine.generate(["the cat"], p)[0].token_ids
    c = engine.generate(["the cat"], SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True))[0].token_ids
    assert a == b and a != c


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"stop": ""}, "stop: a stop string must not be empty"),
        ({"temperature": float("inf")}, "temperature must be a number in"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "0.5"}, "temperature must be a number"),
        ({"top_p": "1"}, "top_p must be a number"),
        ({"seed": "x"}, "seed must be None or an integer"),
        ({"seed": 2**70}, "seed must be None or an integer"),
        ({"seed": True}, "seed"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, fragment):
    with pytest.raises(RequestError, match=fragment):
        SamplingParams(**kwargs)


def test_bad_prompts(tiny_loaded, make_engine):
    engine = make_engine(tiny_loaded("smollm"), max_model_len=64)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("")
    with pytest.raises(RequestError, match="context length"):
        engine.add_request("word " * 200, SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request([10**7], SamplingParams(max_tokens=4))
    assert not engine.has_work()


def test_async_engine_serves_after_bad_request_and_streams(tiny_loaded, make_engine):
    engine = AsyncEngine(make_engine(tiny_loaded("smollm")))

    async def main():
        with pytest.raises(RequestError):
            async for _ in engine.stream("", SamplingParams(max_tokens=4)):
                pass
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        t = asyncio.create_task(ticker())
        events = [ev async for ev in engine.stream("hello", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))]
        t.cancel()
        final = events[-1]
        assert final.finished and final.result.finish_reason == "length"
        assert "".join(e.text for e in events) == final.result.text
        assert sum(len(e.token_ids) for e in events) == 24
        assert ticks > 0  # the event loop kept running while the engine computed
        results = await asyncio.gather(*[engine.generate(f"prompt {i}", SamplingParams(max_tokens=8, temperature=0)) for i in range(5)])
        # "length" only for the results that used their whole max_tokens
        assert all(r.finish_reason == "stop" or (r.finish_reason == "length" and len(r.token_ids) == 8) for r in results)

    try:
        asyncio.run(main())
    finally:
        engine.close()


def test_async_abort_frees_blocks(tiny_loaded, make_engine):
    core = make_engine(tiny_loaded("smollm"))
    engine = AsyncEngine(core)

    async def main():
        agen = engine.stream("abc", SamplingParams(max_tokens=2000 if core.max_model_len > 2100 else 100, temperature=0, ignore_eos=True))
        first = await agen.__anext__()
        assert not first.finished
        await agen.aclose()  # abandoning the stream aborts the request
        for _ in range(100):
            if not core.has_work():
                break
            await asyncio.sleep(0.01)
        assert not core.has_work()
        assert core.blocks.num_free == core.blocks.allocator.num_blocks

    try:
        asyncio.run(main())
    finally:
        engine.close()
