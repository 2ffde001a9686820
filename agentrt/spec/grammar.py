"""Grammar-constrained sampling with xgrammar: compiled grammars (cached per schema) and a
per-sequence GrammarState that masks the target's p at every verified position.

Masks for a step are filled by advancing the matcher through the drafts and rolling it back;
after verification the emitted tokens are committed. Exactness then holds with respect to the
masked distribution, for drafts and plain decoding alike.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import xgrammar as xgr

from agentrt.errors import RequestError
from agentrt.kernels.argmax import argmax_rows
from agentrt.spec.structured import SEPARATORS, OutputFormat


def tokenizer_info(hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """From a `tokenizers.Tokenizer` (byte-level BPE), without transformers at run time."""
    vocab = hf_tokenizer.get_vocab(with_added_tokens=True)
    encoded: list[str] = [""] * max(vocab_size, max(vocab.values()) + 1)
    for tok, i in vocab.items():
        encoded[i] = tok
    return xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids), add_prefix_space=False)


_SHARED: "weakref.WeakKeyDictionary[Any, dict[tuple, GrammarCache]]" = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def shared_grammar_cache(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> "GrammarCache":
    """One GrammarCache per tokenizer object (and vocabulary size and stop tokens), so engines
    over one loaded model share the tokenizer info (~0.2 s to build for a 49k vocabulary, on the
    thread that prepares the first constrained request) and the compiled grammars. `tokenizer`
    is the engine's Tokenizer; its `hf` is what xgrammar reads."""
    key = (vocab_size, tuple(stop_token_ids))
    with _SHARED_LOCK:
        per = _SHARED.setdefault(tokenizer, {})
        if key not in per:
            per[key] = GrammarCache(tokenizer_info(tokenizer.hf, vocab_size, list(stop_token_ids)))
        return per[key]


class GrammarCache:
    """Compiles each output format once per tokenizer (xgrammar also caches internally)."""

    def __init__(self, info: xgr.TokenizerInfo):
        self.info = info
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._compiled: dict[str, xgr.CompiledGrammar] = {}
        self._lock = threading.Lock()

    def compile(self, fmt: OutputFormat) -> xgr.CompiledGrammar:
        key = fmt.cache_key()
        with self._lock:
            if key in self._compiled:
                return self._compiled[key]
        try:
            json_grammar = xgr.Grammar.from_json_schema(fmt.schema, any_whitespace=False, separators=SEPARATORS)
            if fmt.kind == "tool_call" and fmt.tool_choice == "none":
                grammar = xgr.Grammar.from_ebnf('root ::= [^\\[{ \\t\\n] [^]*')  # text only
            elif fmt.kind == "tool_call" and fmt.allow_text:
                # Either the call (a list of calls), or text that does not start like one: with
                # parallel calls not like a lone call object either, which would pass as text.
                first = "[^\\[{ \\t\\n]" if fmt.parallel else "[^{ \\t\\n]"
                grammar = xgr.Grammar.union(json_grammar, xgr.Grammar.from_ebnf(f'root ::= {first} [^]*'))
            else:
                grammar = json_grammar
            compiled = self.compiler.compile_grammar(grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError variously
            raise RequestError(f"response_format: cannot compile the schema into a grammar: {e}") from None
        with self._lock:
            self._compiled[key] = compiled
        return compiled

    def new_bitmask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.info.vocab_size)


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        self.matcher = xgr.GrammarMatcher(compiled)

    def fill_masks(self, draft: list[int], bitmask: torch.Tensor, row0: int) -> int:
        """Fill rows row0..row0+m of `bitmask` with the masks after each accepted prefix of the
        draft, where m is the number of draft tokens the grammar allows in a row (the draft is
        useless past the first disallowed token: its masked p is 0 there). Returns m; the
        matcher ends where it started."""
        m = 0
        for j in range(len(draft) + 1):
            self.matcher.fill_next_token_bitmask(bitmask, row0 + j)
            if j == len(draft) or not self.matcher.accept_token(draft[j]):
                break
            m += 1
            if self.matcher.is_terminated():
                break  # a stop token: the output ends here, the row after it stays unmasked
        if m:
            self.matcher.rollback(m)
        return m

    def commit(self, tokens: list[int]) -> None:
        for t in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(t):
                raise RuntimeError(f"grammar rejected emitted token {t}: masking and sampling disagree")

    def forced_string(self) -> str:
        return "" if self.matcher.is_terminated() else self.matcher.find_jump_forward_string()

    def try_advance(self, tokens: list[int]) -> int:
        """Advance through as many of tokens as the grammar allows; returns how many (the caller
        rolls back)."""
        n = 0
        for t in tokens:
            if not self.matcher.accept_token(t):
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set disallowed logits to -inf in place, on the given rows only. logits [N, V] float32."""
    if rows:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Per row, the first maximal logit among the tokens its mask allows (rows not listed: among
    all): what apply_masks followed by argmax returns, reading the mask bits instead of writing
    -inf into every row (logits [N, V] is not modified). bitmask [N, words] is row-aligned with
    logits. Returns [N] int64."""
    mask_rows = torch.full((logits.shape[0],), -1, dtype=torch.long)
    if rows:
        idx = torch.tensor(rows, dtype=torch.long)
        mask_rows[idx] = idx  # a masked row obeys its own mask row
    return argmax_rows(logits, bitmask, mask_rows)
