"""The verify cost curve (a table of `agentrt bench decode`): what a forward costs when a
sequence is fed n rows at once (its last token plus n - 1 drafts to verify), against a one-row
decode step, per path. Speculation pays only while this stays near 1: it is the figure the k
controller's cost model is fitted to.

Shapes: one sequence fed 1, 2, 4, 8, 16 and 32 rows, and 8 sequences fed 1 and 8 rows each, each
sequence with CONTEXT cached positions (the rows' K/V overwrite the same slots every time, so the
context stays CONTEXT long). The shapes are timed interleaved, `reps` rounds, and each figure is
the median: a drift in the machine's speed moves every shape alike, and the ratios to the one-row
step are taken within one run.

The quantized path is measured on the instruction set the kernels pick (the default) and, where
the CPU has better ones, capped at each lower one too (quant_build.cap_isa), AVX2 there being the
AVX2-only build (quant_build.built_for): every set gives the same bits, so the rows show what the
same model costs on a CPU that has only that set.

At agent contexts: one sequence fed 1-16 rows at LONG_CONTEXT cached positions, on the default
instruction set, and what the attention alone (the fused decoder's attention kernel, every layer,
on caches of the same shape) adds from one row to n: there much of a verification row's cost is
its attention over the context, which the linears' row tiles do not change.

Prefill: one forward of a PREFILL_TOKENS-token prompt from an empty cache, fastest of `reps`, as
tokens/s (llama.cpp's side: one llama_decode of the same token count, bench/llamacpp.py)."""
from __future__ import annotations

import statistics
import time

import torch

CONTEXT = 300
LONG_CONTEXT = 1024  # an agent transcript's or a tool-call prompt's length (bench spec: 756, toolcall: ~1100)
LONG_ROWS = (1, 2, 4, 8, 16)
ONE_SEQ_ROWS = (1, 2, 4, 8, 16, 32)
MULTI_SEQ = ((8, 1), (8, 8))  # (sequences, rows each)
PREFILL_TOKENS = 512
BLOCK = 16


def shapes() -> list[tuple[int, int]]:
    """(sequences, rows each), the one-row step first."""
    return [(1, n) for n in ONE_SEQ_ROWS] + list(MULTI_SEQ)


def _label(seqs: int, rows: int) -> str:
    return f"{seqs}x{rows}"


class _Batches:
    """Sequences 0..S-1 with `context` cached positions each, and the forward batch of S x n rows."""

    def __init__(self, model, seqs: int, max_rows: int, context: int = CONTEXT):
        from agentrt.engine.kv.block_manager import BlockManager
        from agentrt.engine.kv.kv_cache import KVCache

        self.model = model
        per_seq = (context + max_rows + BLOCK - 1) // BLOCK + 1
        self.blocks = BlockManager(seqs * per_seq + 2, BLOCK)
        self.kv = KVCache(model.cfg, seqs * per_seq + 2, BLOCK, model.kv_dtype)
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, model.cfg.vocab_size, (seqs, context + max_rows), generator=g)
        for s in range(seqs):
            self.blocks.grow(s, context + max_rows)
        with torch.inference_mode():
            for s in range(seqs):
                model.forward(self.batch([s], 0, context), self.kv)

    def batch(self, seqs: list[int], start: int, n: int):
        from agentrt.engine.models.attention import build_attention_metadata
        from agentrt.engine.models.batch import ForwardBatch

        positions = torch.arange(start, start + n).repeat(len(seqs))
        slots = torch.tensor([x for s in seqs for x in self.blocks.slots(s, start, start + n)])
        meta = build_attention_metadata([n] * len(seqs), [start + n] * len(seqs), positions,
                                        [self.blocks.tables[s] for s in seqs], BLOCK, torch.device("cpu"))
        return ForwardBatch(self.ids[seqs, start:start + n].reshape(-1), positions, slots, meta)


def forward_ms(model, reps: int, shapes_: list[tuple[int, int]] | None = None,
               context: int = CONTEXT) -> dict[tuple[int, int], float]:
    """Median ms of one forward per shape (default: shapes()), `context` cached positions a
    sequence (see the module docstring)."""
    shapes_ = shapes_ or shapes()
    b = _Batches(model, max(s for s, _ in shapes_), max(r for _, r in shapes_), context)
    batches = {sh: b.batch(list(range(sh[0])), context, sh[1]) for sh in shapes_}
    return _timed(batches, lambda fb: model.forward(fb, b.kv), reps)


def _timed(calls: dict, run, reps: int) -> dict:
    """Median ms of run(x) per entry, the entries interleaved round by round after a warm-up."""
    times: dict = {key: [] for key in calls}
    with torch.inference_mode():
        for x in calls.values():  # warm-up: first-call allocations
            run(x)
        for _ in range(reps):
            for key, x in calls.items():
                t0 = time.perf_counter()
                run(x)
                times[key].append(time.perf_counter() - t0)
    return {key: 1e3 * statistics.median(t) for key, t in times.items()}


def attention_ms(model, rows: tuple[int, ...], reps: int, context: int = LONG_CONTEXT) -> dict[int, float]:
    """Median ms of the quantized decoder's attention alone for one sequence of `context` cached
    positions fed n rows, over all the model's layers (one call a layer, each on its own bf16
    caches of the model's head shape, blocks scattered: the layers' K/V are as far from the cores
    as in a forward)."""
    from agentrt.kernels.quant_decoder import KV_DTYPE, quant_attention

    cfg = model.cfg
    nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(2)
    blocks = (context + max(rows) + BLOCK - 1) // BLOCK
    caches = [tuple(torch.randn(blocks * BLOCK, nkv, d, generator=g).to(KV_DTYPE) for _ in range(2))  # K, V
              for _ in range(cfg.num_hidden_layers)]
    table = torch.randperm(blocks, generator=g).reshape(1, blocks)
    calls = {n: (torch.randn(n, nq, d, generator=g), torch.arange(context, context + n), torch.tensor([0, n]))
             for n in rows}

    def run(x):
        q, positions, cu_q = x
        for k_cache, v_cache in caches:
            quant_attention(q, k_cache, v_cache, cu_q, positions, table, BLOCK, model.scale)

    return _timed(calls, run, reps)


def long_context_rows(model, reps: int, context: int = LONG_CONTEXT) -> tuple[list[dict], float]:
    """One sequence of `context` cached positions fed n rows (LONG_ROWS) on the quantized model's
    default kernels: per n, the forward's ms, its ratio to one row, what the n - 1 rows add to the
    one-row forward and how much of that the attention alone adds (attention_ms includes a Python
    call a layer, which the difference cancels); and 1x16 over 1x1. A model whose rotary table is
    shorter runs at the longest context it has."""
    context = min(context, model.rope.cos.shape[0] - max(LONG_ROWS))
    fwd = forward_ms(model, reps, [(1, n) for n in LONG_ROWS], context)
    attn = attention_ms(model, LONG_ROWS, reps, context)
    step = fwd[(1, 1)]
    rows = []
    for n in LONG_ROWS:
        added, attn_added = fwd[(1, n)] - step, attn[n] - attn[1]
        rows.append({"rows": n, "context": context, "forward_ms": fwd[(1, n)], "over_step1": fwd[(1, n)] / step,
                     "added_ms": added, "attention_added_ms": attn_added,
                     "attention_share_of_added": attn_added / added if n > 1 else None})
    return rows, fwd[(1, 16)] / step


def prefill_tok_s(model, reps: int, n: int = PREFILL_TOKENS) -> float:
    """Tokens/s of one forward of an n-token prompt from an empty cache, fastest of reps."""
    from agentrt.engine.kv.block_manager import BlockManager
    from agentrt.engine.kv.kv_cache import KVCache
    from agentrt.engine.models.attention import build_attention_metadata
    from agentrt.engine.models.batch import ForwardBatch

    blocks = BlockManager(n // BLOCK + 2, BLOCK)
    kv = KVCache(model.cfg, n // BLOCK + 2, BLOCK, model.kv_dtype)
    blocks.grow(0, n)
    ids = torch.randint(0, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(n)
    meta = build_attention_metadata([n], [n], positions, [blocks.tables[0]], BLOCK, torch.device("cpu"))
    fb = ForwardBatch(ids, positions, torch.tensor(blocks.slots(0, 0, n)), meta)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            model.forward(fb, kv)
            best = min(best, time.perf_counter() - t0)
    return n / best


def cost_row(label: str, ms: dict[tuple[int, int], float]) -> dict:
    """One table row: the one-row step's ms, then each shape's ms over it."""
    step = ms[(1, 1)]
    return {"path": label, "step1_ms": step,
            **{f"{_label(*sh)}": ms[sh] / step for sh in shapes() if sh != (1, 1)}}


def quantized_rows(model, weights: str, reps: int, progress) -> tuple[list[dict], dict[str, float]]:
    """Rows for the quantized model on its kernels' instruction set and each lower one this CPU
    runs, and {isa: 1x16 over 1x1}. AVX2 on a CPU with more is the AVX2-only build (built_for),
    what a CPU without AVX-512 runs: the native build capped at AVX2 compiles its loops with
    AVX-512's 32 vector registers. The kernels are left on their best set."""
    from agentrt.kernels.quant_build import AVX2_MARCH, ISAS, built_for, cap_isa, isa, quant_kernels

    lib = quant_kernels()
    best = isa(lib)
    rows, ratio16 = [], {}
    try:
        for name in reversed(ISAS[1:ISAS.index(best) + 1]):
            label = f"{weights}, {name}" + (" (default)" if name == best else "")
            if name == "avx2" and best != "avx2":
                progress.print(f"  verify cost: {weights} on the {AVX2_MARCH} build (AVX2)")
                with built_for(AVX2_MARCH) as avx2:
                    if avx2 is None:
                        continue
                    ms = forward_ms(model, reps)
                label += f" ({AVX2_MARCH} build)"
            else:
                cap_isa(lib, name)
                progress.print(f"  verify cost: {weights} on {name}")
                ms = forward_ms(model, reps)
            rows.append(cost_row(label, ms))
            ratio16[name] = ms[(1, 16)] / ms[(1, 1)]
    finally:
        cap_isa(lib, best)
    return rows, ratio16


def tile_attention(model, weights: str, reps: int, progress) -> dict | None:
    """The same model with its attention's scores and P.V on AMX-BF16 tiles (quant_build's
    attention_tiles, off by default), where this CPU and build have them: the verify-cost row at
    CONTEXT, 1x16 over 1x1 at LONG_CONTEXT, and the prefill's tokens/s; None elsewhere. The switch
    is put back as it was."""
    from agentrt.kernels.quant_build import attention_tiles, quant_kernels

    lib = quant_kernels()
    was = attention_tiles(lib)
    try:
        attention_tiles(lib, True)
    except ValueError as e:
        progress.print(f"  verify cost with the attention on AMX tiles skipped: {e}")
        return None
    try:
        progress.print(f"  verify cost: {weights}, attention on AMX-BF16 tiles")
        row = cost_row(f"{weights}, attention on AMX-BF16 tiles", forward_ms(model, reps))
        context = min(LONG_CONTEXT, model.rope.cos.shape[0] - 16)
        long = forward_ms(model, reps, [(1, 1), (1, 16)], context)
        return {"row": row, "long16": long[(1, 16)] / long[(1, 1)], "prefill_tok_s": prefill_tok_s(model, 2)}
    finally:
        attention_tiles(lib, was)

