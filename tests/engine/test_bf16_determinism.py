"""bf16 decoding is batch-invariant: a request's greedy tokens are bit-identical with speculation
off and with every drafter at every k (fixed and adaptive), alone or in any batch (prefill and
decode mixed, requests arriving mid-run), with whole or chunked prefill under any step token
budget, on a prefix-cache hit or miss, and with its KV held or recomputed after preemption. With
a fixed seed and drafter, sampled tokens do not depend on what runs beside the request, nor on whether it was drafted.

What makes it hold: every C kernel computes a row the same way whatever else is in the call
(tests/kernels/test_batch_invariance.py checks each kernel bit for bit). The property test draws
its scenarios with hypothesis under a fixed, derandomized budget of examples."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_runs import run_requests

from agentrt.engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from agentrt.kernels.cpu_build import unsupported_reason

pytestmark = pytest.mark.skipif(unsupported_reason() is not None,
                                reason=f"bf16 runs on the C kernels only where they load: {unsupported_reason()}")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a location",
           "parameters": {"type": "object", "properties": {"location": {"type": "string", "maxLength": 40},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}
SEARCH = {"type": "function", "function": {"name": "search_web", "description": "Search the web", "parameters": {
          "type": "object", "properties": {"query": {"type": "string", "maxLength": 60}}, "required": ["query"]}}}
TOOLS = {"type": "tool_call", "tools": [WEATHER, SEARCH]}
SMOLLM2_PROMPTS = [  # (messages, response_format): tool calls, where template drafts are long, and free text
    ([{"role": "user", "content": "What's the weather in San Francisco, CA?"}], TOOLS),
    ([{"role": "user", "content": "Search the web for cheap flights to Rome in May."}], TOOLS),
    ([{"role": "user", "content": "Is it raining in Mariposa right now, in celsius?"}], TOOLS),
    ([{"role": "user", "content": "List five fruits and their colours."}], None),
    ([{"role": "user", "content": "Write a python function that reverses a list."}], None),
]
DRAFTERS = [SpecConfig(), SpecConfig(drafter="template"), SpecConfig(drafter="template", k=1),
            SpecConfig(drafter="template", k=15), SpecConfig(drafter="suffix"), SpecConfig(drafter="suffix", k=4)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_source):
    from agentrt.engine.loading.model_loader import load_model

    return load_model(str(smollm2_source.path), "bfloat16", progress=False)


def _engine(loaded, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_tokens", 4096)
    return LLMEngine(EngineConfig(model=str(loaded.source.path), dtype="bfloat16", **kw), loaded=loaded)




def _greedy(fmt) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, response_format=fmt)


_alone: dict[int, list[int]] = {}


def _reference(loaded, i: int) -> list[int]:
    """Prompt i alone: no speculation, whole prefill, nothing cached."""
    if i not in _alone:
        prompt, fmt = SMOLLM2_PROMPTS[i]
        _alone[i] = run_requests(_engine(loaded, prefix_caching=False), [(prompt, _greedy(fmt))])[0]
    return _alone[i]


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(picks=st.lists(st.integers(0, len(SMOLLM2_PROMPTS) - 1), min_size=1, max_size=4),
       arrivals=st.lists(st.integers(0, 6), min_size=4, max_size=4),
       spec=st.sampled_from(DRAFTERS),
       budget=st.sampled_from([16, 48, 1024]),
       warm=st.booleans(),
       kv_tokens=st.sampled_from([4096, 256]))
def test_greedy_tokens_do_not_depend_on_batch_drafts_chunking_or_cache(smollm2_bf16, picks, arrivals, spec, budget,
                                                                        warm, kv_tokens):
    """budget: the step's token budget (16 and 48 chunk every prompt); warm: the prompts ran
    before, so their prefixes hit the cache; 256 KV tokens preempt running requests."""
    expected = [_reference(smollm2_bf16, i) for i in picks]
    engine = _engine(smollm2_bf16, spec=spec, max_num_batched_tokens=budget, kv_cache_tokens=kv_tokens)
    requests = [(SMOLLM2_PROMPTS[i][0], _greedy(SMOLLM2_PROMPTS[i][1])) for i in picks]
    if warm:
        run_requests(engine, requests[:1])
    assert run_requests(engine, requests, arrivals[: len(picks)]) == expected


@pytest.mark.parametrize("variant", ["llama3", "mistral"])
def test_tiny_random_model_greedy_is_invariant(tiny_loaded, variant):
    """A random model's logits are full of near-ties: any bit that changed with the batch would
    flip tokens. Suffix drafts (random models repeat themselves) at k = 8 and adaptive, in a
    batch with chunked prefill, against each prompt alone without drafts."""
    loaded = tiny_loaded(variant, "bfloat16")
    assert loaded.model.kernels_enabled
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 19, 33)]
    alone = [run_requests(_engine(loaded, prefix_caching=False), [(p, params)])[0] for p in prompts]
    for spec in (SpecConfig(drafter="suffix", k=8), SpecConfig(drafter="suffix")):
        engine = _engine(loaded, spec=spec, max_num_batched_tokens=16)
        assert run_requests(engine, [(p, params) for p in prompts], [0, 2, 5]) == alone


@pytest.mark.parametrize("spec", [SpecConfig(), SpecConfig(drafter="suffix", k=4), SpecConfig(drafter="suffix"),
                                  SpecConfig(drafter="template", k=8), SpecConfig(drafter="template")])
def test_seeded_sampling_does_not_depend_on_drafts_or_what_runs_beside(smollm2_bf16, spec):
    """Temperature 1 with a fixed seed: the same tokens as the request alone without drafts,
    when drafted at any k and beside other requests arriving while it decodes, with chunked
    prefill. Sampling draws the token at each output position with that position's own uniform
    and verifies token drafts by coupling (agentrt/engine/step/step_sampler.py), so drafts change how
    many tokens a pass emits, never which."""
    prompt, fmt = SMOLLM2_PROMPTS[1] if spec.drafter == "template" else SMOLLM2_PROMPTS[3]
    mine = (prompt, SamplingParams(max_tokens=32, temperature=1.0, seed=7, response_format=fmt))
    others = [(SMOLLM2_PROMPTS[i][0], SamplingParams(max_tokens=20, temperature=0.8, seed=i,
               response_format=SMOLLM2_PROMPTS[i][1])) for i in (0, 4, 2)]
    alone = run_requests(_engine(smollm2_bf16), [mine])[0]
    busy = run_requests(_engine(smollm2_bf16, spec=spec, max_num_batched_tokens=32), [others[0], mine, *others[1:]], [0, 1, 3, 4])
    assert busy[1] == alone
