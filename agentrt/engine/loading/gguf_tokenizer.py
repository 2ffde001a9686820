"""A GGUF file's tokenizer as a `tokenizers` Tokenizer and its tokenizer_config: byte-level BPE
vocabularies (Llama 3, Qwen, SmolLM2) built here, SentencePiece ones (Gemma) in gguf_spm_tokenizer."""
from __future__ import annotations

from typing import Any

from agentrt.errors import ModelLoadError

_GGUF_TYPE_CONTROL = 3  # llama.cpp token type CONTROL: <|im_start|>, <|endoftext|>, ...
_GGUF_TYPE_USER_DEFINED = 4
# Pre-tokenizer families (`tokenizer.ggml.pre`) we can rebuild. The StarCoder family (SmolLM's
# tokenizer) isolates each digit before the GPT-2 byte-level split, as llama.cpp does for it.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}
_PLAIN_BYTE_LEVEL_PRE = {None, "default", "gpt2", "gpt-2"}


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata field's value, or default when the file does not have it."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _byte_level_tokenizer(reader: Any, tokens: list[str], types: list[int], pre: str | None) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError("GGUF tokenizer has duplicate tokens")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # Special tokens already have ids in the vocabulary; adding them makes the tokenizer match them
    # whole in text (chat markup) and lets decode(skip_special_tokens=True) drop them.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _GGUF_TYPE_CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _GGUF_TYPE_USER_DEFINED]
    )
    return tok


def build_gguf_tokenizer(reader: Any) -> tuple[Any, dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config dict) from the GGUF's byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model = gguf_field(reader, "tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ModelLoadError(f"GGUF tokenizer model {model!r} is not supported (supported: byte-level BPE 'gpt2', "
                             "SentencePiece 'llama' for gemma3)")
    pre = gguf_field(reader, "tokenizer.ggml.pre")
    if model == "gpt2" and pre not in _DIGIT_SPLIT_PRE | _PLAIN_BYTE_LEVEL_PRE:
        raise ModelLoadError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {sorted(str(p) for p in _DIGIT_SPLIT_PRE | _PLAIN_BYTE_LEVEL_PRE)})"
        )
    tokens: list[str] = list(gguf_field(reader, "tokenizer.ggml.tokens"))
    types: list[int] = list(gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    arch = gguf_field(reader, "general.architecture")
    if model == "llama":
        from agentrt.engine.loading.gguf_spm_tokenizer import build_spm_tokenizer

        tok = build_spm_tokenizer(tokens, types, arch)
    else:
        tok = _byte_level_tokenizer(reader, tokens, types, pre)
    vocab = {t: i for i, t in enumerate(tokens)}

    def token_at(key: str) -> str | None:
        i = gguf_field(reader, f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
    add_bos = bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab[bos])]
        )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": bool(gguf_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(gguf_field(reader, f"{gguf_field(reader, 'general.architecture')}.context_length", 2048)),
    }
    template = gguf_field(reader, "tokenizer.chat_template")
    if template is None and arch == "gemma3":  # llama.cpp's Gemma 3 files carry none
        from agentrt.engine.loading.gguf_spm_tokenizer import GEMMA3_CHAT_TEMPLATE

        template = GEMMA3_CHAT_TEMPLATE
    if template is not None:
        tokenizer_config["chat_template"] = template
    return tok, tokenizer_config
