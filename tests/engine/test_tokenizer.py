"""Tokenizer: ids, chat templates and incremental detokenization, against transformers."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agentrt.engine.chat.tokenizer import IncrementalDetokenizer, Tokenizer
from agentrt.errors import ModelLoadError, RequestError

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world!",
    "  leading spaces,\ttabs and 12345 digits: 3.14159 x 12",
    "héllo wörld — 你好，世界 🤖🎉 naïve café",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "def f(x):\n    return x**2  # square\n\n\n",
    "I'm sure they'll say 'no' — won't they?",
    '{"name": "get_weather", "arguments": {"city": "Zürich"}}',
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_source) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_source.path)


@pytest.fixture(scope="module")
def hf_gguf_tok():
    """transformers' own tokenizer built from the GGUF (independent of our conversion)."""
    from agentrt.engine.loading import registry

    gguf = registry.find_gguf(registry.KNOWN_MODELS["smollm2-135m-instruct"])
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def test_tiny_gguf_tokenizer_equals_transformers_gguf_tokenizer(tmp_path):
    from agentrt.engine.loading.gguf_convert import convert_gguf
    from tiny_models import save_tiny_gguf

    gguf = save_tiny_gguf(tmp_path / "tiny.gguf")
    tok = Tokenizer.from_dir(convert_gguf(gguf, tmp_path / "converted", progress=False))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf.name)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.eos_token_ids == (3,) and tok.bos_token_id == 2
    assert tok.chat_template == ref.chat_template


@pytest.mark.slow
def test_smollm2_ids_equal_transformers_gguf_tokenizer(smollm2_tok, hf_gguf_tok, smollm2_source):
    hf_dir_tok = transformers.AutoTokenizer.from_pretrained(smollm2_source.path)
    for text in TEXTS:
        ids = smollm2_tok.encode(text)
        assert ids == hf_gguf_tok.encode(text, add_special_tokens=False), text
        assert ids == hf_dir_tok.encode(text, add_special_tokens=False), text
        assert smollm2_tok.decode(ids, skip_special_tokens=False) == text


def test_smollm2_fixed_expectations(smollm2_tok):
    assert smollm2_tok.encode("Hello world!") == [19556, 905, 17]
    assert smollm2_tok.encode("<|im_start|>user\nHi<|im_end|>\n") == [1, 4093, 198, 26843, 2, 198]
    assert smollm2_tok.encode("Hello", add_special_tokens=True) == smollm2_tok.encode("Hello")  # no BOS for SmolLM2
    assert (smollm2_tok.vocab_size, smollm2_tok.bos_token_id, smollm2_tok.eos_token_ids) == (49152, 1, (2,))
    assert smollm2_tok.decode([1, 4093, 198, 26843, 2]) == "user\nHi"
    assert not smollm2_tok.has_tools_template
    from tokenizers import Tokenizer as HFTokenizer

    assert isinstance(smollm2_tok.hf, HFTokenizer)


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_smollm2_chat_template_equals_transformers(smollm2_tok, smollm2_source, generation_prompt):
    ref = transformers.AutoTokenizer.from_pretrained(smollm2_source.path)
    for messages in (
        [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☃"}],
    ):
        ours = smollm2_tok.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        assert ours == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours.endswith("<|im_start|>assistant\n") == generation_prompt


@pytest.mark.parametrize("variant", ["qwen2", "llama3"])
def test_tools_template_equals_transformers(tiny_model_dir, variant):
    tok = Tokenizer.from_dir(tiny_model_dir(variant))
    ref = transformers.AutoTokenizer.from_pretrained(tiny_model_dir(variant))
    assert tok.has_tools_template
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temp_c": 21}'},
    ]
    ours = tok.apply_chat_template(messages, tools=TOOLS)
    assert ours == ref.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert json.dumps(TOOLS[0]) in ours and '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in ours
    without = tok.apply_chat_template(messages[:1])
    assert "<tools>" not in without


def test_template_sees_special_tokens_and_can_reject_messages(tiny_model_dir):
    d = tiny_model_dir("llama2")
    tok, ref = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    ours = tok.apply_chat_template(messages)
    assert ours == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == "<s>[INST] Hi [/INST] Hello</s>[INST] Bye [/INST]"
    assert not tok.has_tools_template
    with pytest.raises(RequestError, match="Conversation roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_template_runs_sandboxed(tiny_model_dir, tmp_path):
    d = Path(shutil.copytree(tiny_model_dir("smollm"), tmp_path / "m"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    for template in ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "{% set _ = messages.append(1) %}"):
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
        with pytest.raises(RequestError, match="chat template rejected"):
            Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])


def test_stop_tokens_from_every_source(tiny_model_dir):
    assert Tokenizer.from_dir(tiny_model_dir("qwen2")).eos_token_ids == (1, 3)  # config </s> + <|im_end|>
    assert Tokenizer.from_dir(tiny_model_dir("llama3")).eos_token_ids == (1, 3)  # a list in config.json
    assert Tokenizer.from_dir(tiny_model_dir("smollm")).eos_token_ids == (3,)
    llama2 = Tokenizer.from_dir(tiny_model_dir("llama2"))
    assert llama2.eos_token_ids == (1,) and llama2.bos_token_id == 0
    assert llama2.encode("Hi", add_special_tokens=True)[0] == 0  # this tokenizer adds BOS


def test_missing_tokenizer_files(tiny_model_dir, tmp_path):
    d = Path(shutil.copytree(tiny_model_dir("smollm"), tmp_path / "m"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(d)
    assert tok.encode("hi") and not tok.has_tools_template
    with pytest.raises(ModelLoadError, match="no chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="missing tokenizer.json"):
        Tokenizer.from_dir(d)


# ---------------------------------------------------------------- incremental detokenization


def _stream(tok: Tokenizer, ids: list[int], **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    return [detok.push(i) for i in ids], detok


def test_incremental_text_equals_decode_on_unicode(smollm2_tok):
    for text in TEXTS:
        ids = smollm2_tok.encode(text)
        pieces, detok = _stream(smollm2_tok, ids)
        assert "".join(pieces) == detok.text == smollm2_tok.decode(ids)
        assert not any("\ufffd" in p for p in pieces)
    # The unicode text really does split characters across tokens.
    ids = smollm2_tok.encode(TEXTS[2])
    assert any("\ufffd" in smollm2_tok.decode([i]) for i in ids)


def test_incremental_on_byte_tokens(tiny_model_dir):
    """The tiny vocabulary has no multi-byte merges: every multi-byte character arrives byte by byte."""
    tok = Tokenizer.from_dir(tiny_model_dir("qwen2"))
    text = "日本語 ☃ 🤖 über the <|im_end|>end"
    ids = tok.encode(text)
    assert all(tok.decode([i]) == "\ufffd" for i in ids[:3])  # 日 is three byte tokens
    pieces, detok = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text.replace("<|im_end|>", "")
    assert pieces[:4] == ["", "", "日", ""]
    assert not any("\ufffd" in p for p in pieces)
    pieces, detok = _stream(tok, ids, skip_special_tokens=False)
    assert "".join(pieces) == text


def test_finish_flushes_an_incomplete_character(smollm2_tok):
    ids = smollm2_tok.encode("ok 🤖")
    cut = next(n for n in range(1, len(ids)) if smollm2_tok.decode(ids[:n]).endswith("\ufffd"))
    pieces, detok = _stream(smollm2_tok, ids[:cut])
    assert "".join(pieces) == "ok"
    assert detok.finish().startswith(" ") and detok.text == smollm2_tok.decode(ids[:cut])
    assert detok.finish() == ""


def test_prompt_context_keeps_the_first_generated_space(smollm2_tok):
    prompt = smollm2_tok.encode("The capital of France is")
    generated = smollm2_tok.encode(" Paris, of course.")
    pieces, detok = _stream(smollm2_tok, generated, prompt_ids=prompt)
    assert detok.text == " Paris, of course." and detok.token_ids == generated
