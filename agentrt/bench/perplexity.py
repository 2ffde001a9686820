"""Perplexity on one fixed English text, the quality figure `agentrt bench decode` prints next to
each path's speed.

The text is the opening of Jane Austen's Pride and Prejudice (1813, public domain), ~500 tokens.
Every path scores the same token ids (our tokenizer, no special tokens): one prefill over the
whole text, then exp(mean over positions 1..n-1 of -log p(token | the tokens before it)), the
log-probabilities a log-softmax of each position's logits in fp64. The quantized and the
dequantized paths run the same weights, so their gap is what the quantized path's int8
activation rounding costs. llama.cpp on the same file rounds activations too, in blocks of its
own per weight type (Q8_0 / Q8_1 of 32 values, Q8_K of 256 for the K-quants):
bench/ggml_rounding.py runs our float model with that rounding, the figure to hold llama.cpp's
against.
"""
from __future__ import annotations

import math

import torch

TEXT = """It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.

However little known the feelings or views of such a man may be on his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered the rightful property of some one or other of their daughters.

"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is let at last?"

Mr. Bennet replied that he had not.

"But it is," returned she; "for Mrs. Long has just been here, and she told me all about it."

Mr. Bennet made no answer.

"Do you not want to know who has taken it?" cried his wife impatiently.

"You want to tell me, and I have no objection to hearing it."

This was invitation enough.

"Why, my dear, you must know, Mrs. Long says that Netherfield is taken by a young man of large fortune from the north of England; that he came down on Monday in a chaise and four to see the place, and was so much delighted with it, that he agreed with Mr. Morris immediately; that he is to take possession before Michaelmas, and some of his servants are to be in the house by the end of next week."

"What is his name?"

"Bingley."

"Is he married or single?"

"Oh! Single, my dear, to be sure! A single man of large fortune; four or five thousand a year. What a fine thing for our girls!"

"How so? How can it affect them?"

"My dear Mr. Bennet," replied his wife, "how can you be so tiresome! You must know that I am thinking of his marrying one of them."

"Is that his design in settling here?"

"Design! Nonsense, how can you talk so! But it is very likely that he may fall in love with one of them, and therefore you must visit him as soon as he comes."
"""


def text_ids(tokenizer, max_positions: int | None = None) -> list[int]:
    """TEXT's token ids, cut to the model's context (a tiny test model's is shorter than TEXT)."""
    return tokenizer.encode(TEXT)[:max_positions]


def from_logits(logits: torch.Tensor, ids: list[int]) -> float:
    """Perplexity of ids[1:] given logits [len(ids), vocab] (row i predicts ids[i + 1])."""
    logp = torch.log_softmax(logits[: len(ids) - 1].double(), dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean().item()
    return math.exp(nll)


def ours(loaded, ids: list[int]) -> float:
    """Our model's perplexity over ids: one prefill through model.forward, logits of every row."""
    return of_model(loaded.model, ids)


def of_model(model, ids: list[int]) -> float:
    """A LlamaModel's perplexity over ids (ours, without the loaded model around it)."""
    from agentrt.engine.kv.block_manager import BlockManager
    from agentrt.engine.kv.kv_cache import KVCache
    from agentrt.engine.models.attention import build_attention_metadata
    from agentrt.engine.models.batch import ForwardBatch

    block = 16
    num_blocks = len(ids) // block + 2
    blocks = BlockManager(num_blocks, block)
    kv = KVCache(model.cfg, num_blocks, block, model.kv_dtype)
    n = len(ids)
    blocks.grow(0, n)
    positions = torch.arange(n)
    meta = build_attention_metadata([n], [n], positions, [blocks.tables[0]], block, torch.device("cpu"))
    batch = ForwardBatch(torch.tensor(ids), positions, torch.tensor(blocks.slots(0, 0, n)), meta)
    with torch.inference_mode():
        logits = model.forward(batch, kv).logits  # [n, vocab]: no logits_indices, every row
    return from_logits(logits, ids)
