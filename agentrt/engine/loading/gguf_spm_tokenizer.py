"""A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model == "llama"`, as Gemma 3 writes it)
rebuilt as a `tokenizers` BPE, the way transformers' GemmaTokenizer and its GGUF reader build it
(transformers.integrations.gguf.gguf_tokenizer_mapping.gemma_tokenizer), without transformers:

- a token of two or more spaces is stored as real spaces; the model looks it up spelled with
  U+2581 ("▁▁"), so it is respelled;
- the file lists no merges: every split of a token into two tokens of the vocabulary is a merge,
  ranked by the merged token's place in the file (Gemma's scores do not follow its merge order);
- BPE with byte fallback (<0x00>..<0xFF>), spaces normalized to "▁", split after each space;
- CONTROL tokens (type 3: <bos>, <start_of_turn>, ...) are special, USER_DEFINED ones (type 4:
  runs of newlines or tabs, [multimodal]) are matched whole.
"""
from __future__ import annotations

from typing import Any

from agentrt.errors import ModelLoadError

SPACE = "\u2581"
_CONTROL, _USER_DEFINED = 3, 4


def _merges(tokens: list[str]) -> list[tuple[str, str]]:
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []  # (rank of the merged token, -len(left), -len(right), left id, right id, left, right)
    for rank, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                ranked.append((rank, -len(left), -len(right), li, ri, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm_tokenizer(tokens: list[str], types: list[int], arch: str) -> Any:
    """tokenizers.Tokenizer for a GGUF SentencePiece vocabulary (Gemma's layout)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    if arch != "gemma3":
        raise ModelLoadError(f"GGUF SentencePiece tokenizers are supported for gemma3 files only (this one is {arch!r})")
    tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError("GGUF tokenizer has duplicate tokens")
    unk = "<unk>" if "<unk>" in vocab else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(tokens), fuse_unk=True, unk_token=unk, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    return tok


# Gemma 3's chat format (its model card's template without the image parts), for GGUF files that
# carry none: a system message goes before the first user turn; the assistant's role is "model".
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
