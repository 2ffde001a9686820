"""llama.cpp as a peer in the benches, through llama-cpp-python (`make peers`), on the GGUF file
our quantized path runs, with the same thread count.

Optional: `load()` returns None when llama_cpp does not import (not installed, or its shared
library does not load), and the benches then skip its rows with a note.

Out of process: `load()` gives a LlamaCppPeer, which runs LlamaCpp in a child process of its own
(bench/peer_process.py). A crash in llama.cpp's native code (llama.cpp built natively for a CPU
with AMX dies by SIGILL in batched matmuls) ends that child only: its calls raise PeerFailed
naming the signal, and the benches put that in the peer's row and finish the rest.

- `greedy`: batch 1 or B sequences through the low-level `llama_batch` / `llama_decode` API, one
  context with n_seq_max = B and seq_id s per sequence; one prefill of every prompt, then one
  decode call per step feeding each sequence's last token; greedy = argmax of the logits (what
  llama.cpp's greedy sampler does). Only the decode steps are timed. The low-level loop, not
  `Llama.generate`, so that no Python sampling chain adds to llama.cpp's step.
- `perplexity`: one decode of the whole text with every position's logits.
- `prefill_tok_s`: one decode of a whole prompt (prompt evaluation), logits of its last token.
- `generate_run`: `Llama.generate` at temperature 0, plain or with llama-cpp-python's
  `LlamaPromptLookupDecoding` as its draft model (bench spec).
Flash attention is on in every context: llama.cpp's own default ("auto") turns it on for the CPU,
and on the 2-core EPYC it decoded as fast at batch 1 and ~7% faster at batch 8 than without.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from agentrt.bench.peer_process import PeerFailed, PeerProcess

LOOKUP_NUM_PRED_TOKENS = 10  # llama-cpp-python's default, and transformers' prompt-lookup example value
SKIP_NOTE = "llama.cpp rows skipped: llama_cpp does not import here (`make peers` builds llama-cpp-python)"


def import_llama_cpp():
    try:
        import llama_cpp
    except (ImportError, OSError):  # OSError: the package is there but libllama does not load
        return None
    return llama_cpp


def load(gguf_path: Path | str | None, threads: int | None = None, flash_attn: bool = True) -> LlamaCppPeer | None:
    """The peer on gguf_path in a child process, or None when llama_cpp is not importable or there
    is no GGUF. A peer whose child died or failed while loading is returned too: each of its
    calls raises PeerFailed saying how (the benches' row for it says so)."""
    lc = import_llama_cpp()
    if gguf_path is None or lc is None:
        return None
    return LlamaCppPeer(lc.__version__, gguf_path, threads or torch.get_num_threads(), flash_attn)


class LlamaCppPeer:
    """LlamaCpp's measurements, each run in the peer's child process (see the module docstring)."""

    def __init__(self, version: str, gguf_path: Path | str, threads: int, flash_attn: bool = True):
        self.version = version
        try:
            self.process: PeerProcess | None = PeerProcess(f"{__name__}:LlamaCpp", str(gguf_path), threads, flash_attn,
                                                           name="llama.cpp")
            self.load_failure: PeerFailed | None = None
        except PeerFailed as e:
            self.process, self.load_failure = None, e

    @property
    def gone(self) -> PeerFailed | None:
        """Why the peer's process no longer answers (it died, or failed to load), or None."""
        return self.load_failure if self.process is None else self.process.gone

    def _call(self, method: str, *args: Any) -> Any:
        if self.process is None:
            raise self.load_failure
        return self.process.call(method, *args)

    def greedy(self, prompts: list[list[int]], n_tokens: int) -> tuple[list[list[int]], float]:
        return self._call("greedy", prompts, n_tokens)

    def decode_tok_s(self, prompts: list[list[int]], n_tokens: int) -> float:
        return self._call("decode_tok_s", prompts, n_tokens)

    def perplexity(self, ids: list[int]) -> float:
        return self._call("perplexity", ids)

    def prefill_tok_s(self, ids: list[int], reps: int) -> float:
        return self._call("prefill_tok_s", ids, reps)

    def generate_run(self, prompt_ids: list[int], max_tokens: int, eos_ids: tuple[int, ...],
                     lookup: bool) -> tuple[list[int], float, float, float]:
        return self._call("generate_run", prompt_ids, max_tokens, eos_ids, lookup)

    def close(self) -> None:
        if self.process is not None:
            self.process.close()


def _round_up(n: int, to: int = 256) -> int:
    return (n + to - 1) // to * to


class LlamaCpp:
    """The peer itself, in the process that makes it (LlamaCppPeer's child)."""

    def __init__(self, gguf_path: Path | str, threads: int, flash_attn: bool = True):
        self.lc = import_llama_cpp()
        self.path, self.threads, self.flash_attn = str(gguf_path), threads, flash_attn
        self.version = self.lc.__version__
        # The Llama object owns the model (and llama.cpp's backend set-up and quiet logging); the
        # low-level contexts below are made on its model.
        self.llm = self._llama(n_ctx=256)
        self.n_vocab = self.llm.n_vocab()
        self._generators: dict[tuple[bool, int], Any] = {}

    def _llama(self, n_ctx: int, draft_model=None):
        return self.lc.Llama(model_path=self.path, n_ctx=n_ctx, n_batch=min(n_ctx, 2048), n_threads=self.threads,
                             n_threads_batch=self.threads, n_gpu_layers=0, flash_attn=self.flash_attn,
                             draft_model=draft_model, verbose=False)

    @contextlib.contextmanager
    def _context(self, n_ctx: int, n_batch: int, n_seq: int):
        lc = self.lc
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, n_seq
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.no_perf = True
        ctx = lc.llama_init_from_model(self.llm.model, cp)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context (n_ctx {n_ctx}, {n_seq} sequences)")
        batch = lc.llama_batch_init(n_batch, 0, n_seq)
        try:
            yield ctx, batch
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)

    def _decode(self, ctx, batch, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, seq_id, wants logits)."""
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, logits
            batch.seq_id[i][0] = seq
        rc = self.lc.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _logits(self, ctx, i: int) -> torch.Tensor:
        import numpy as np

        return torch.from_numpy(np.ctypeslib.as_array(self.lc.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,)))

    def greedy(self, prompts: list[list[int]], n_tokens: int) -> tuple[list[list[int]], float]:
        """Greedy continuations of n_tokens for each prompt, all in flight at once; returns them
        and the seconds of the n_tokens - 1 decode steps (the first token comes from the prefill)."""
        b = len(prompts)
        prefill = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        last = [i for i, e in enumerate(prefill) if e[3]]
        per_seq = _round_up(max(map(len, prompts)) + n_tokens + 1)
        with self._context(b * per_seq, max(len(prefill), b), b) as (ctx, batch):
            self._decode(ctx, batch, prefill)
            out = [[int(self._logits(ctx, i).argmax())] for i in last]
            t0 = time.perf_counter()
            for step in range(1, n_tokens):
                self._decode(ctx, batch, [(out[s][-1], len(prompts[s]) + step - 1, s, True) for s in range(b)])
                for s in range(b):
                    out[s].append(int(self._logits(ctx, s).argmax()))
            return out, time.perf_counter() - t0

    def decode_tok_s(self, prompts: list[list[int]], n_tokens: int) -> float:
        _, seconds = self.greedy(prompts, n_tokens)
        return len(prompts) * (n_tokens - 1) / seconds

    def perplexity(self, ids: list[int]) -> float:
        from agentrt.bench.perplexity import from_logits

        n = len(ids)
        with self._context(_round_up(n + 1), n, 1) as (ctx, batch):
            self._decode(ctx, batch, [(t, j, 0, True) for j, t in enumerate(ids)])
            logits = torch.stack([self._logits(ctx, i) for i in range(n)])
        return from_logits(logits, ids)

    def prefill_tok_s(self, ids: list[int], reps: int) -> float:
        """Tokens/s of prompt evaluation: one llama_decode of all of ids (logits of the last only)
        in a fresh context, fastest of reps."""
        n, best = len(ids), float("inf")
        for _ in range(reps + 1):  # the first: warm-up
            with self._context(_round_up(n + 1), n, 1) as (ctx, batch):
                t0 = time.perf_counter()
                self._decode(ctx, batch, [(t, j, 0, j == n - 1) for j, t in enumerate(ids)])
                best = min(best, time.perf_counter() - t0)
        return n / best

    def generate_run(self, prompt_ids: list[int], max_tokens: int, eos_ids: tuple[int, ...],
                     lookup: bool) -> tuple[list[int], float, float, float]:
        """One greedy `Llama.generate` from a cleared cache (as our fresh engine per run), plain or
        with prompt-lookup drafts; returns (tokens, start, first token, finished) on time.monotonic."""
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        n_ctx = _round_up(len(prompt_ids) + max_tokens + LOOKUP_NUM_PRED_TOKENS + 1)
        key = (lookup, n_ctx)
        if key not in self._generators:
            self._generators.clear()  # one at a time: with drafts, scores hold n_ctx x vocab floats
            draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_NUM_PRED_TOKENS) if lookup else None
            self._generators[key] = self._llama(n_ctx, draft)
        llm = self._generators[key]
        llm.reset()
        tokens: list[int] = []
        t0 = time.monotonic()
        first = None
        for tok in llm.generate(list(prompt_ids), temp=0.0, repeat_penalty=1.0, reset=True):
            first = first or time.monotonic()
            tokens.append(int(tok))
            if tok in eos_ids or len(tokens) >= max_tokens:
                break
        finished = time.monotonic()
        return tokens, t0, first or finished, finished
