"""A stack of Llama decoder layers on GGUF-quantized weights in one kernel call
(csrc/cpu_quant_decoder.c), and the table of weight and cache addresses it reads.

Per layer (h [T, hidden] fp32, updated in place; linears as quant_linear.quant_linear):
    qkv  = quant_linear(rms_norm(h, attn_norm), Wqkv) + bias      rotary on q, k; K/V into their slots
    attn = each query over its own sequence's positions 0..p      (paged caches, bf16)
    h   += quant_linear(attn, Wo)
    h   += quant_linear(silu(gate) * up, Wdown),   [gate | up] = quant_linear(rms_norm(h, mlp_norm), Wgate_up)
with, where a layer has them (QuantLayerWeights' optional fields): QK-norm before rotary, post-norms
of the attention and MLP outputs before their adds, GeGLU, its own rotary tables, a sliding window;
then out = rms_norm(h[rows], final_norm). quant_model_forward runs a whole model in one call: the
embedding lookup first, the head after.
"""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import torch

from agentrt.kernels.decoder import Dims
from agentrt.kernels.quant_build import quant_kernels
from agentrt.kernels.quant_formats import QuantWeight

LAYER_FIELDS = 28  # the row layout csrc/cpu_quant_decoder.c reads
MODEL_FIELDS = 22  # agentrt_quant_forward's model table
# The caches the kernels read and write (csrc/cpu_quant.h, kv_t): bf16 halves the bytes a step reads
# per cached token and the memory the cache holds against fp32, and feeds bf16 dot products
# (VDPBF16PS); each K/V value is rounded once, and the queries as they are (kv_round).
KV_DTYPE = torch.bfloat16
KV_FLUSH = 2.0**-50  # smaller magnitudes are stored as a signed zero (csrc/cpu_quant.h, kv_t)
ATTN_CHUNK = 64  # positions per chunk of the kernel's attention (csrc/cpu_quant_attention.c)


def kv_round(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels round a K/V value or a query (f32_to_kv): to bf16, ties to even,
    magnitudes below KV_FLUSH to a signed zero."""
    return torch.where(x.abs() < KV_FLUSH, x * 0.0, x).to(KV_DTYPE)
_ERRORS = {-1: "a weight format or dimension the kernel does not run", -2: "an index out of range (a token id outside "
           "the embedding, a position past the rotary table, a slot, block or row outside the cache or batch, or cu_q "
           "not a partition of the tokens)",
           -3: "out of memory"}


@dataclass(frozen=True)
class QuantLayerWeights:
    # [(nq + 2 nkv) d, hidden], or up to three row blocks of it in their own formats (GGUF files
    # mix them: q and k Q5_0, v Q8_0), each computed into its columns of the row
    qkv: QuantWeight | tuple[QuantWeight, ...]
    qkv_bias: torch.Tensor | None  # [(nq + 2 nkv) d] fp32 contiguous
    o: QuantWeight  # [hidden, nq d]
    gate_up: QuantWeight  # [2 inter, hidden]: gate rows, then up rows
    down: QuantWeight  # [hidden, inter]
    attn_norm: torch.Tensor  # [hidden] fp32 contiguous
    mlp_norm: torch.Tensor
    # the later families' features (None / False: absent); norms fp32 contiguous, as the model
    # applies them (Gemma's already 1 + w)
    q_norm: torch.Tensor | None = None  # [head_dim]: RMSNorm of each q head before rotary (with k_norm)
    k_norm: torch.Tensor | None = None  # [head_dim]
    attn_out_norm: torch.Tensor | None = None  # [hidden]: the attention output's norm before its add
    mlp_out_norm: torch.Tensor | None = None  # [hidden]: the MLP output's
    cos: torch.Tensor | None = None  # [P, head_dim / 2]: this layer's rotary tables (None: the model's)
    sin: torch.Tensor | None = None
    window: int | None = None  # a query at p sees positions p - window + 1 .. p
    gelu: bool = False  # GeGLU: gelu_tanh(gate) * up instead of silu(gate) * up

    @property
    def qkv_parts(self) -> tuple[QuantWeight, ...]:
        return self.qkv if isinstance(self.qkv, tuple) else (self.qkv,)

    def __post_init__(self):
        if not 1 <= len(self.qkv_parts) <= 3:
            raise ValueError(f"qkv must be one to three row blocks, got {len(self.qkv_parts)}")
        for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm", "cos", "sin"):
            t = getattr(self, name)
            if t is not None and (t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu"):
                raise ValueError(f"{name} must be fp32 contiguous on the CPU, got {t.dtype} on {t.device}")
        if (self.q_norm is None) != (self.k_norm is None) or (self.cos is None) != (self.sin is None):
            raise ValueError("q_norm and k_norm, cos and sin come in pairs")
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must be positive, got {self.window}")


def quant_layer_table(layers: list[QuantLayerWeights], k_caches: list[torch.Tensor],
                      v_caches: list[torch.Tensor]) -> torch.Tensor:
    """[L, LAYER_FIELDS] int64 of addresses: valid while the weights and caches live. Caches
    [num_slots, nkv, d] bf16 (KV_DTYPE) contiguous on the CPU."""
    rows = []
    for w, kc, vc in zip(layers, k_caches, v_caches):
        for c in (kc, vc):
            if c.dtype != KV_DTYPE or c.device.type != "cpu" or not c.is_contiguous():
                raise ValueError(f"the quantized decoder needs contiguous bf16 CPU caches, got {c.dtype} on {c.device}")
        qkv = list(w.qkv_parts) + [None] * (3 - len(w.qkv_parts))
        rows.append([
            qkv[0].data.data_ptr(), qkv[0].kernel_code, 0 if w.qkv_bias is None else w.qkv_bias.data_ptr(),
            w.o.data.data_ptr(), w.o.kernel_code, w.gate_up.data.data_ptr(), w.gate_up.kernel_code,
            w.down.data.data_ptr(), w.down.kernel_code, w.attn_norm.data_ptr(), w.mlp_norm.data_ptr(),
            kc.data_ptr(), vc.data_ptr(), *(_ptr(t) for t in (w.q_norm, w.k_norm, w.attn_out_norm, w.mlp_out_norm,
                                                             w.cos, w.sin)),
            w.window or 0, int(w.gelu), qkv[0].shape[0],
            *(x for p in qkv[1:] for x in ((0, 0, 0) if p is None else (p.data.data_ptr(), p.kernel_code, p.shape[0]))),
        ])
    return torch.tensor(rows, dtype=torch.long).reshape(-1, LAYER_FIELDS)


@dataclass(frozen=True)
class TreeKeys:
    """Token trees in a batch: token t's keys at positions p >= base[t] are the cache slots
    path_slots[t, p - base[t]] (its ancestors' and its own, in depth order) instead of its block
    table's; base[t] > positions[t] for a token outside any tree. So a tree node attends to
    exactly the keys, in the order, of the same path fed as a chain, and its bits are the chain's."""

    base: torch.Tensor  # [T] int64
    path_slots: torch.Tensor  # [T, max_depth + 1] int64 cache slots (entries past a token's path: unused)


def _tree_tensors(tree: TreeKeys | None, T: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    if tree is None:
        return None
    if tree.base.shape != (T,) or tree.path_slots.dim() != 2 or tree.path_slots.shape[0] != T:
        raise ValueError(f"a token tree needs base [{T}] and path_slots [{T}, depth], got {tuple(tree.base.shape)} "
                         f"and {tuple(tree.path_slots.shape)}")
    return _i64(tree.base, "tree base"), _i64(tree.path_slots, "tree path_slots")


def _tree_args(tensors: tuple[torch.Tensor, torch.Tensor] | None) -> tuple:
    """The kernel's (tree_base, path_slots, path_stride) arguments."""
    if tensors is None:
        return None, None, 0
    base, paths = tensors
    return base.data_ptr(), paths.data_ptr(), paths.stride(0)


def _i64(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool or t.device.type != "cpu":
        raise ValueError(f"{name} must be integers on the CPU, got {t.dtype} on {t.device}")
    return t.to(torch.long).contiguous()


def quant_decoder_layers(
    table: torch.Tensor,  # quant_layer_table(...), first num_layers rows used
    num_layers: int,
    dims: Dims,
    h: torch.Tensor,  # [T, hidden] fp32 contiguous, updated in place
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, d/2] fp32 (RotaryEmbedding.cos)
    sin: torch.Tensor,
    slots: torch.Tensor,  # [T] int64
    num_slots: int,  # rows of every cache
    cu_q: torch.Tensor,  # [B + 1] int64
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    block_size: int,
    final_norm: torch.Tensor | None = None,  # [hidden] fp32
    rows: torch.Tensor | None = None,  # [n_out] int64 rows of h to normalize (None: all)
    num_threads: int | None = None,
    lib: ctypes.CDLL | None = None,  # a given build (tests: the scalar one); default: quant_kernels()
    tree: TreeKeys | None = None,  # token trees' key paths (see TreeKeys)
) -> torch.Tensor | None:  # [n_out, hidden] fp32: rms_norm(h[rows], final_norm), when final_norm is given
    lib = lib if lib is not None else quant_kernels()
    if lib is None:
        raise RuntimeError("the quantized kernels are not available on this machine (see agentrt.kernels.quant_build)")
    T = h.shape[0]
    if h.dtype != torch.float32 or h.dim() != 2 or h.shape[1] != dims.hidden or not h.is_contiguous():
        raise ValueError(f"h must be [T, {dims.hidden}] fp32 contiguous, got {h.dtype} {tuple(h.shape)}")
    if not 0 <= num_layers <= table.shape[0]:
        raise ValueError(f"num_layers {num_layers} outside 0..{table.shape[0]}")
    for t, name in ((cos, "cos"), (sin, "sin")):
        if t.dtype != torch.float32 or t.shape[-1] != dims.head_dim // 2 or not t.is_contiguous():
            raise ValueError(f"{name} must be [P, {dims.head_dim // 2}] fp32 contiguous")
    positions, slots, cu_q = _i64(positions, "positions"), _i64(slots, "slot_mapping"), _i64(cu_q, "cu_q")
    block_tables = _i64(block_tables, "block_tables")
    if positions.numel() != T or slots.numel() != T:
        raise ValueError(f"positions and slot_mapping must have {T} entries")
    if block_tables.dim() != 2 or block_tables.shape[0] < cu_q.numel() - 1:
        raise ValueError(f"block_tables must be [B, max_blocks], a row per sequence: got {tuple(block_tables.shape)}")
    trees = _tree_tensors(tree, T)  # held until the call returns
    out = None
    if final_norm is not None:
        rows = None if rows is None else _i64(rows.reshape(-1), "logits_indices")
        out = torch.empty(T if rows is None else rows.numel(), dims.hidden, dtype=torch.float32)
    rc = lib.agentrt_quant_decoder(
        table.data_ptr(), num_layers, h.data_ptr(), T, dims.hidden, dims.intermediate, dims.num_heads,
        dims.num_kv_heads, dims.head_dim, dims.eps, dims.scale, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        cos.shape[0], slots.data_ptr(), num_slots, cu_q.numel() - 1, cu_q.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), block_tables.shape[1], block_size,
        None if final_norm is None else final_norm.data_ptr(), None if rows is None else rows.data_ptr(),
        0 if out is None else out.shape[0], None if out is None else out.data_ptr(),
        num_threads or torch.get_num_threads(), *_tree_args(trees),
    )
    if rc != 0:
        raise (IndexError if rc == -2 else RuntimeError)(f"quant_decoder_layers: {_ERRORS.get(rc, f'error {rc}')}")
    return out


def quant_attention(
    q: torch.Tensor,  # [T, nq, d] fp32, rotary applied
    k_cache: torch.Tensor,  # [num_slots, nkv, d] bf16 contiguous
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,  # [B + 1] int64
    positions: torch.Tensor,  # [T] int64
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    block_size: int,
    scale: float,
    window: int | None = None,  # a sliding layer: a query at p sees p - window + 1 .. p
    num_threads: int | None = None,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:  # [T, nq, d]
    """The fused decoder's attention alone (csrc/cpu_quant_attention.c): quant_attention_reference's
    result (bf16 queries and softmax numerators; scores and P.V are bf16 dot products with fp32
    sums), each query's bits independent of the other rows and the thread count."""
    lib = lib if lib is not None else quant_kernels()
    if lib is None:
        raise RuntimeError("the quantized kernels are not available on this machine (see agentrt.kernels.quant_build)")
    T, nq, d = q.shape
    for t, name, dtype in ((q, "q", torch.float32), (k_cache, "k_cache", KV_DTYPE), (v_cache, "v_cache", KV_DTYPE)):
        if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be {dtype} contiguous on the CPU, got {t.dtype} on {t.device}")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 3 or k_cache.shape[2] != d:
        raise ValueError(f"caches must be [num_slots, nkv, {d}], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    positions, cu_q, block_tables = _i64(positions, "positions"), _i64(cu_q, "cu_q"), _i64(block_tables, "block_tables")
    if positions.numel() != T or block_tables.dim() != 2 or block_tables.shape[0] < cu_q.numel() - 1:
        raise ValueError(f"positions must have {T} entries and block_tables a row per sequence")
    out = torch.empty_like(q)
    rc = lib.agentrt_quant_attention(q.data_ptr(), nq * d, T, nq, k_cache.shape[1], d, scale, positions.data_ptr(),
                                     cu_q.numel() - 1, cu_q.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                                     block_tables.shape[1], block_size, k_cache.shape[0], k_cache.data_ptr(),
                                     v_cache.data_ptr(), window or 0, out.data_ptr(),
                                     num_threads or torch.get_num_threads())
    if rc != 0:
        raise (IndexError if rc == -2 else RuntimeError)(f"quant_attention: {_ERRORS.get(rc, f'error {rc}')}")
    return out


def quant_attention_reference(
    q: torch.Tensor,  # [T, nq, d] fp32, rotary applied
    k_cache: torch.Tensor,  # [num_slots, nkv, d] bf16
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,  # [B + 1] int64
    positions: torch.Tensor,  # [T] int64
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    block_size: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [T, nq, d]
    """quant_attention's arithmetic in PyTorch: the queries rounded as the caches (kv_round); each
    query's positions in chunks of ATTN_CHUNK fixed by position, per chunk the softmax numerators
    e^(s - the chunk's max) rounded as K/V values (P.V takes them as bf16), their sum and P.V, then
    the chunks folded. The kernel sums in other orders (bf16 pair products, exact, added in fp32)
    and its exp is a polynomial, so the two agree to rounding, and a numerator that sits on a bf16
    rounding boundary may round the other way (2^-8 of that one weight)."""
    q = kv_round(q).float()
    nq, nkv = q.shape[1], k_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(cu_q.numel() - 1):
        t0, t1 = int(cu_q[b]), int(cu_q[b + 1])
        pos = positions[t0:t1]
        chunks = int(pos.max()) // ATTN_CHUNK + 1
        offs = torch.arange(chunks * ATTN_CHUNK)
        seen = offs <= int(pos.max())  # the positions past the last are zeros here (the kernel reads none)
        slots = block_tables[b, torch.where(seen, offs, 0) // block_size] * block_size + offs % block_size
        k, v = (torch.where(seen.view(-1, 1, 1), c[slots].float(), 0.0).repeat_interleave(nq // nkv, dim=1)
                for c in (k_cache, v_cache))  # [C * 64, nq, d]
        scores = torch.matmul(q[t0:t1].transpose(0, 1), k.permute(1, 2, 0)) * scale  # [nq, n, C * 64]
        hidden = offs.view(1, 1, -1) > pos.view(1, -1, 1)
        if window:
            hidden |= offs.view(1, 1, -1) <= pos.view(1, -1, 1) - window
        scores = scores.masked_fill(hidden, float("-inf")).view(nq, t1 - t0, chunks, ATTN_CHUNK)
        m = scores.amax(dim=-1, keepdim=True)  # [nq, n, C, 1]; -inf for a chunk the query does not see
        p = kv_round(torch.exp(scores - torch.where(m.isinf(), 0.0, m))).float()
        acc = torch.matmul(p.transpose(1, 2), v.permute(1, 0, 2).reshape(nq, chunks, ATTN_CHUNK, -1)).transpose(1, 2)
        # acc: [nq, n, C, d]
        w = torch.exp(m - m.amax(dim=2, keepdim=True))  # each chunk's scale in the fold, 0 where unseen
        num, den = (acc * w).sum(dim=2), (p.sum(dim=-1, keepdim=True) * w).sum(dim=2)
        out[t0:t1] = (num / den).transpose(0, 1)
    return out


def quant_decoder_reference(
    layers: list[QuantLayerWeights],
    k_caches: list[torch.Tensor],  # [num_slots, nkv, d] (bf16 as the kernel's, or fp32), written
    v_caches: list[torch.Tensor],
    dims: Dims,
    h: torch.Tensor,  # [T, hidden] fp32 (not modified)
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    cu_q: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:  # h after the layers
    """The same stack from the per-op PyTorch references and one quant_linear call per linear."""
    from agentrt.kernels.linear import rms_norm_reference
    from agentrt.kernels.paged_attention import paged_attention_reference, rotary_kv_write_reference
    from agentrt.kernels.quant_linear import quant_linear

    T, nq, d = h.shape[0], dims.num_heads, dims.head_dim
    for w, kc, vc in zip(layers, k_caches, v_caches):
        x = rms_norm_reference(h, w.attn_norm, dims.eps)
        qkv = torch.cat([quant_linear(x, p, lib=lib) for p in w.qkv_parts], dim=-1)
        if w.qkv_bias is not None:
            qkv = qkv + w.qkv_bias
        rotary_kv_write_reference(qkv, positions, cos, sin, slots, kc, vc, nq)
        q = qkv[:, : nq * d].reshape(T, nq, d)
        attn = (quant_attention_reference(q, kc, vc, cu_q, positions, block_tables, block_size, dims.scale)
                if kc.dtype == KV_DTYPE else
                paged_attention_reference(q, kc, vc, cu_q, positions, block_tables, block_size, dims.scale))
        h = h + quant_linear(attn.reshape(T, nq * d), w.o, lib=lib)
        gate, up = quant_linear(rms_norm_reference(h, w.mlp_norm, dims.eps), w.gate_up, lib=lib).chunk(2, dim=-1)
        h = h + quant_linear((torch.nn.functional.silu(gate) * up).contiguous(), w.down, lib=lib)
    return h


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _float_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


@dataclass(frozen=True)
class QuantModelTable:
    """What quant_model_forward reads: `fields` [MODEL_FIELDS] int64, addresses valid while the
    weights, norms, rotary tables and caches live (the layer table is kept here)."""

    fields: torch.Tensor
    layer_table: torch.Tensor
    hidden: int
    head_rows: int


def quant_model_table(layer_table: torch.Tensor, dims: Dims, cos: torch.Tensor, sin: torch.Tensor, num_slots: int,
                      block_size: int, final_norm: torch.Tensor, embedding: QuantWeight,
                      head: QuantWeight, embed_scale: float | None = None,
                      softcap: float | None = None) -> QuantModelTable:
    """The layers (quant_layer_table) and their caches' geometry, the rotary tables, the final
    norm, the embedding and head weights, for quant_model_forward; embed_scale multiplies the
    embedding rows (Gemma: sqrt(hidden)), softcap caps the logits (cap * tanh(logits / cap))."""
    for t, name in ((cos, "cos"), (sin, "sin"), (final_norm, "final_norm")):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be fp32 contiguous on the CPU")
    if cos.shape[-1] != dims.head_dim // 2 or final_norm.shape != (dims.hidden,):
        raise ValueError(f"cos/sin must be [P, {dims.head_dim // 2}] and final_norm [{dims.hidden}]")
    if embedding.shape[1] != dims.hidden or head.shape[1] != dims.hidden:
        raise ValueError(f"embedding {tuple(embedding.shape)} and head {tuple(head.shape)} must have {dims.hidden} "
                         "columns")
    fields = torch.tensor([
        layer_table.data_ptr(), dims.hidden, dims.intermediate, dims.num_heads, dims.num_kv_heads, dims.head_dim,
        _float_bits(dims.eps), _float_bits(dims.scale), cos.data_ptr(), sin.data_ptr(), cos.shape[0], num_slots,
        block_size, final_norm.data_ptr(), embedding.data.data_ptr(), embedding.kernel_code, embedding.shape[0],
        head.data.data_ptr(), head.kernel_code, head.shape[0], _float_bits(embed_scale or 0.0),
        _float_bits(softcap or 0.0),
    ], dtype=torch.long)
    assert fields.numel() == MODEL_FIELDS
    return QuantModelTable(fields, layer_table, dims.hidden, head.shape[0])


def quant_reserve(dims: Dims, tokens: int, lib: ctypes.CDLL | None = None) -> None:
    """Size and touch the calling thread's kernel buffers for a step of up to `tokens` tokens of a
    model with these dimensions (the decoder's activations, the linears' int8 rows), so that the
    first step that large neither grows the process nor pays its page faults then. Call it on the
    thread that runs the forwards."""
    lib = lib if lib is not None else quant_kernels()
    if lib is None:
        raise RuntimeError("the quantized kernels are not available on this machine (see agentrt.kernels.quant_build)")
    rc = lib.agentrt_quant_reserve(tokens, dims.hidden, dims.intermediate, dims.num_heads, dims.num_kv_heads,
                                   dims.head_dim)
    if rc == -1:
        raise ValueError(f"quant_reserve: bad step size {tokens} or dimensions {dims}")
    if rc != 0:
        raise MemoryError(f"quant_reserve: no memory for the buffers of a {tokens}-token step")


def _index(t: torch.Tensor, n: int | None, name: str) -> torch.Tensor:
    if not (t.dtype is torch.long and t.is_cpu and t.is_contiguous()):  # the engine's own tensors pass as they are
        t = _i64(t, name)
    if n is not None and t.shape != (n,):
        raise ValueError(f"{name} must have {n} entries, got shape {tuple(t.shape)}")
    return t


def quant_model_forward(
    model: QuantModelTable,
    num_layers: int,  # layers run (at most the layer table's rows)
    ids: torch.Tensor,  # [T] token ids
    positions: torch.Tensor,  # [T] int64
    slots: torch.Tensor,  # [T] int64
    cu_q: torch.Tensor,  # [B + 1] int64
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    rows: torch.Tensor | None,  # [n_out] rows of the batch to project (None: all)
    num_threads: int | None = None,
    lib: ctypes.CDLL | None = None,
    tree: TreeKeys | None = None,  # token trees' key paths (see TreeKeys)
) -> tuple[torch.Tensor, torch.Tensor]:  # hidden [n_out, hidden] (final-normed), logits [n_out, head rows]
    """embed -> layers -> final norm of `rows` -> head, in one kernel call (a decode step's
    Python between separate calls costs more than the calls themselves)."""
    lib = lib if lib is not None else quant_kernels()
    if lib is None:
        raise RuntimeError("the quantized kernels are not available on this machine (see agentrt.kernels.quant_build)")
    if not 0 <= num_layers <= model.layer_table.shape[0]:
        raise ValueError(f"num_layers {num_layers} outside 0..{model.layer_table.shape[0]}")
    T = ids.shape[0] if ids.dim() == 1 else -1
    ids, positions = _index(ids, T, "input_ids"), _index(positions, T, "positions")
    slots = _index(slots, T, "slot_mapping")
    cu_q = _index(cu_q, None, "cu_q")
    if not (block_tables.dtype is torch.long and block_tables.is_cpu and block_tables.is_contiguous()):
        block_tables = _i64(block_tables, "block_tables")
    if block_tables.dim() != 2 or block_tables.shape[0] < cu_q.shape[0] - 1:
        raise ValueError(f"block_tables must be [B, max_blocks], a row per sequence: got {tuple(block_tables.shape)}")
    rows = None if rows is None else _index(rows.reshape(-1), None, "logits_indices")
    n_out = T if rows is None else rows.shape[0]
    trees = _tree_tensors(tree, T)  # held until the call returns
    h = torch.empty(T, model.hidden)
    hidden = torch.empty(n_out, model.hidden)
    logits = torch.empty(n_out, model.head_rows)
    rc = lib.agentrt_quant_forward(
        model.fields.data_ptr(), num_layers, ids.data_ptr(), T, positions.data_ptr(), slots.data_ptr(),
        cu_q.shape[0] - 1, cu_q.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1],
        None if rows is None else rows.data_ptr(), n_out, h.data_ptr(), hidden.data_ptr(), logits.data_ptr(),
        num_threads or torch.get_num_threads(), *_tree_args(trees),
    )
    if rc != 0:
        raise (IndexError if rc == -2 else RuntimeError)(f"quant_model_forward: {_ERRORS.get(rc, f'error {rc}')}")
    return hidden, logits
