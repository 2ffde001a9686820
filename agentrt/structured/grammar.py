"""Grammar-constrained sampling with xgrammar: compiled grammars (cached per schema) and a
per-sequence GrammarState that masks the target's p at every verified position.

Masks for a step are filled by advancing the matcher through the drafts and rolling it back;
after verification the emitted tokens are committed. Exactness then holds with respect to the
masked distribution, for drafts and plain decoding alike.
"""
from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch

from agentrt.errors import RequestError
from agentrt.kernels.argmax import argmax_rows
from agentrt.structured.output_format import SEPARATORS, OutputFormat


class _Xgrammar:
    """xgrammar, imported on first use: the import takes ~1.2 s (it loads transformers), a
    quarter of a CLI start, and only constrained requests need it."""

    def __getattr__(self, name: str) -> Any:  # only for names not yet set on the instance
        import xgrammar

        value = getattr(xgrammar, name)
        setattr(self, name, value)
        return value


xgr = _Xgrammar()


def tokenizer_info(hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """From a `tokenizers.Tokenizer`, without transformers at run time: byte-level BPE (GPT-2's
    byte-to-unicode alphabet: SmolLM2, Llama 3, Qwen), or a SentencePiece vocabulary with byte
    fallback (Gemma, Llama 2: U+2581 for a space, <0xXX> for bytes), which xgrammar must decode
    as such or it would refuse every token holding a space."""
    vocab = hf_tokenizer.get_vocab(with_added_tokens=True)
    encoded: list[str] = [""] * max(vocab_size, max(vocab.values()) + 1)
    for tok, i in vocab.items():
        encoded[i] = tok
    return xgr.TokenizerInfo(encoded, vocab_type(vocab), vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids), add_prefix_space=False)


def vocab_type(vocab: dict[str, int]) -> Any:
    """BYTE_FALLBACK for a SentencePiece vocabulary (its 256 byte tokens <0x00>..<0xFF> and
    U+2581-marked words), else BYTE_LEVEL."""
    byte_tokens = sum(1 for t in vocab if len(t) == 6 and t.startswith("<0x") and t.endswith(">"))
    if byte_tokens >= 256 and any(t.startswith("\u2581") for t in vocab):
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.BYTE_LEVEL


_SHARED: "weakref.WeakKeyDictionary[Any, dict[tuple, GrammarCache]]" = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def shared_grammar_cache(tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                         max_bytes: int | None = None) -> "GrammarCache":
    """One GrammarCache per tokenizer object (and vocabulary size and stop tokens), so engines
    over one loaded model share the tokenizer info (~0.2 s to build for a 49k vocabulary, on the
    thread that prepares the first constrained request) and the compiled grammars. `tokenizer`
    is the engine's Tokenizer; its `hf` is what xgrammar reads. max_bytes, when given, becomes the
    cache's bound (GrammarCache)."""
    key = (vocab_size, tuple(stop_token_ids))
    with _SHARED_LOCK:
        per = _SHARED.setdefault(tokenizer, {})
        if key not in per:
            per[key] = GrammarCache(tokenizer_info(tokenizer.hf, vocab_size, list(stop_token_ids)))
        if max_bytes is not None:
            per[key].bound(max_bytes)
        return per[key]


LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
STRICT_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def strict_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """xgrammar's rule for the characters of a length-bounded string allows raw control characters
    (its rule for other strings does not), which JSON forbids: json.loads rejects such output. The
    same grammar, with that rule as strict as the other."""
    text = str(grammar)
    if LOOSE_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(LOOSE_STRING_CHAR, STRICT_STRING_CHAR))


def _text_grammar(excluded_first: str, openers: tuple[str, ...] = ()) -> xgr.Grammar:
    """Text that does not start with a blank or any of `excluded_first` (how a call starts), or
    that starts with one of `openers` (ToolCallFormat.text_openers)."""
    chars = "".join("\\" + c if c in "[]\\^-" else c for c in excluded_first)
    alternatives = [f"[^{chars} \\t\\n] [^]*"] + [f"{json.dumps(o)} [^]*" for o in openers]
    return xgr.Grammar.from_ebnf("root ::= " + " | ".join(f"({a})" for a in alternatives))


def family_grammar(fmt: OutputFormat, call_grammar: xgr.Grammar) -> xgr.Grammar:
    """A model family's call turn (structured.tool_formats) around the grammar of one call object: the
    turn alone (tool_choice required or named), or text that does not start like it (none), or
    either (auto)."""
    text = _text_grammar(fmt.syntax.first_chars(fmt.parallel), fmt.syntax.text_openers)
    if fmt.tool_choice == "none":
        return text
    ebnf, root = fmt.syntax.grammar_ebnf(str(call_grammar), fmt.parallel)
    calls = xgr.Grammar.from_ebnf(ebnf, root_rule_name=root)
    return xgr.Grammar.union(calls, text) if fmt.allow_text else calls


GRAMMAR_CACHE_BYTES = 64 << 20  # compiled grammars kept, least recently used dropped past this


class GrammarCache:
    """Compiles each output format once per tokenizer and keeps the compiled grammars of the
    formats used most recently, up to `max_bytes` of them (xgrammar's own size of each: ~0.17 MB
    for a small object schema, ~0.6 MB for a call of one of five tools, with this 49k-token
    vocabulary); past that the least recently used is dropped, and compiled again (~5-50 ms) if
    it comes back. Without a bound, a server whose clients send a new schema with each request
    would keep every grammar it ever compiled. xgrammar's own compile cache is off: this one
    already keys by format, and it would keep a second, unbounded copy."""

    def __init__(self, info: xgr.TokenizerInfo, max_bytes: int = GRAMMAR_CACHE_BYTES):
        self.info = info
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        # format key -> [compiled grammar, its bytes, its minimum completion tokens once known]
        self._compiled: OrderedDict[str, list[Any]] = OrderedDict()
        self.nbytes = 0
        self._lock = threading.Lock()
        self.max_bytes = 0
        self.bound(max_bytes)

    def bound(self, max_bytes: int) -> None:
        """Keep at most max_bytes of compiled grammars (dropping the least recently used now)."""
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"the grammar cache's bound must be an integer >= 0 bytes, got {max_bytes!r}")
        with self._lock:
            self.max_bytes = max_bytes
            self._evict()

    def _evict(self) -> None:
        # the newest stays even when it alone is over the bound: a request is using it
        while self.nbytes > self.max_bytes and len(self._compiled) > 1:
            _, (_, gone, _) = self._compiled.popitem(last=False)
            self.nbytes -= gone

    def __len__(self) -> int:
        return len(self._compiled)

    def _cached(self, key: str) -> list[Any] | None:
        with self._lock:
            entry = self._compiled.get(key)
            if entry is not None:
                self._compiled.move_to_end(key)
            return entry

    def _entry(self, fmt: OutputFormat) -> list[Any]:
        key = fmt.cache_key()
        entry = self._cached(key)
        if entry is not None:
            return entry
        try:
            json_grammar = strict_strings(xgr.Grammar.from_json_schema(fmt.schema, any_whitespace=False,
                                                                       separators=SEPARATORS))
            if fmt.kind == "tool_call" and fmt.syntax is not None:
                grammar = family_grammar(fmt, json_grammar)
            elif fmt.kind == "tool_call" and fmt.tool_choice == "none":
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
        entry = [compiled, int(compiled.memory_size_bytes), None]
        with self._lock:
            if key not in self._compiled:  # another thread may have compiled it meanwhile
                self._compiled[key] = entry
                self.nbytes += entry[1]
                self._evict()
            return self._compiled.get(key, entry)

    def compile(self, fmt: OutputFormat) -> xgr.CompiledGrammar:
        return self._entry(fmt)[0]

    def minimum_tokens(self, fmt: OutputFormat, encode: Any) -> int:
        """Tokens of the shortest output the completion search finds for this format (a call, for
        a tool-call format that may also answer in text): the least max_tokens that can be valid."""
        entry = self._entry(fmt)
        if entry[2] is not None:
            return entry[2]
        m = xgr.GrammarMatcher(entry[0])
        start = fmt.json_start if fmt.kind == "tool_call" and fmt.allow_text else ""
        ids = encode(start)
        ok = all(m.accept_token(t) for t in ids)
        text = completion_from(m, encode, start) if ok else None
        entry[2] = 0 if text is None else len(encode(start + text))
        return entry[2]

    def new_bitmask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.info.vocab_size)


# Characters a completion tries, in order: inside a JSON string, end it; outside, end an array
# or object, then separators (before digits, or a number would grow digit by digit), then the
# shortest values; then the rest of printable ASCII (keys, enum values). A backslash is never
# tried: escapes would need a pair.
_REST = "".join(chr(c) for c in range(32, 127) if chr(c) not in '"}],:0tfn[{\\')
ORDER_IN_STRING = '"' + _REST + '}],:0tfn[{'
ORDER_OUTSIDE = ']},:"0tfn[{' + _REST
ORDER_ESCAPED = 'n"\\/bfrt'  # after a backslash in a string: the one-character escapes
COMPLETION_MAX_OPS = 4000  # matcher steps one search may take (each ~1 us)
COMPLETION_MAX_CHARS = 400  # also bounds the search's recursion


def json_string_state(text: str, state: tuple[bool, bool] = (False, False)) -> tuple[bool, bool]:
    """(inside a string, right after a backslash in one) at the end of JSON text that starts in
    `state`."""
    inside, escaped = state
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\" and inside:
            escaped = True
        elif ch == '"':
            inside = not inside
    return inside, escaped


def completion_from(m: xgr.GrammarMatcher, encode: Any, text: str) -> str | None:
    """A short text that completes the output `text` from matcher m's state (m is advanced: pass
    a fork). Depth first over characters (ORDER_IN_STRING / ORDER_OUTSIDE by where the text
    stands), taking the grammar's forced strings whole: close what is open, add what is
    required, the shortest scalars. Short, not always shortest; None when the search gives up."""
    if m.is_terminated() or m.is_completed():
        return ""
    ops = [0]

    def accept(ids: list[int]) -> int:
        n = 0
        for t in ids:
            ops[0] += 1
            if not m.accept_token(t):
                break
            n += 1
        return n

    def search(depth: int, state: tuple[bool, bool]) -> str | None:
        if m.is_completed():
            return ""
        if depth >= COMPLETION_MAX_CHARS or ops[0] >= COMPLETION_MAX_OPS:
            return None
        forced = m.find_jump_forward_string()
        order = ORDER_ESCAPED if state[1] else ORDER_IN_STRING if state[0] else ORDER_OUTSIDE
        for piece in [forced] if forced else order:
            if ops[0] >= COMPLETION_MAX_OPS:
                return None
            ids = encode(piece)
            n = accept(ids)
            if n == len(ids):
                rest = search(depth + len(piece), json_string_state(piece, state))
                if rest is not None:
                    return piece + rest
            m.rollback(n)
        return None

    return search(0, json_string_state(text))


class GrammarState:
    """One sequence's position in its grammar: the matcher, and what masks, drafts and the budget's
    completion search (engine.step.budget, which keeps its own state) ask of it."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        self.matcher = xgr.GrammarMatcher(compiled)

    def completion(self, encode: Any, text: str, after: list[int] = ()) -> str | None:
        """A short text that completes the output `text` (written so far, then `after` tokens
        more, which the grammar must allow) so that the grammar's root is matched and a stop
        token may follow; None when the search gives up or `after` is not allowed. "" when
        already complete. See completion_from."""
        m = self.matcher.fork()
        for t in after:
            if m.is_terminated() or not m.accept_token(t):
                return "" if m.is_terminated() else None
        return completion_from(m, encode, text)

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

    @property
    def complete(self) -> bool:
        """The output so far is a whole value of the grammar (a stop token may follow)."""
        return self.matcher.is_terminated() or self.matcher.is_completed()


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
