"""Run a loaded model on its GGUF's quantized weights (Q8_0 / Q4_0 / Q4_1) in our kernels (#24).

`quantize_model_from_gguf(model, gguf_path)` takes an fp32 LlamaModel loaded from that GGUF's
conversion (engine/gguf_convert.py: the same weights, dequantized) and swaps, in place:
- every Linear whose GGUF tensors are all Q8_0/Q4_0/Q4_1 for a QuantLinear holding the file's
  blocks (agentrt/kernels/quant_linear.py's quant_linear; the fp32 weight is dropped);
- the token embedding for a QuantEmbedding (quant_embedding: exactly the dequantized rows);
- the output head (the embedding's blocks when tied) for a QuantLinear.
Norms, rotary tables and attention stay fp32; tensors in other formats keep their fp32 Linear.

Names follow the converter: gguf_convert.hf_tensor_name maps GGUF to HF names, and Q/K rows get
gguf_convert.unpermute_rotary, applied to the quantized rows (a block runs along K, inside a row,
so permuting whole rows of blocks is exact). QuantLinear is a drop-in for layers.Linear (which
has no fused epilogue: norm, rotary, residual and SiLU gating stay in the model's forward).

Output differs from the fp32 model by the kernel's int8 activation rounding (quant_linear.py);
each linear is batch invariant (a row's bits do not depend on the other rows).
"""
from __future__ import annotations

from pathlib import Path

import torch

from agentrt.engine.gguf_convert import hf_tensor_name, unpermute_rotary
from agentrt.kernels.quant_formats import FORMAT_BY_GGML_TYPE, QuantWeight, quant_weight_from_gguf
from agentrt.kernels.quant_linear import quant_embedding, quant_linear

# A model Linear (llama.py's _Layer attribute) -> the HF tensors it stacks, in order.
_LAYER_LINEARS = {
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o": ("self_attn.o_proj.weight",),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down": ("mlp.down_proj.weight",),
}
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _stack(parts: list[QuantWeight]) -> list[QuantWeight]:
    """Row blocks of one format -> one weight (one kernel call); mixed formats stay separate."""
    if len(parts) == 1 or len({p.format for p in parts}) > 1 or len({p.shape[1] for p in parts}) > 1:
        return parts
    data = torch.cat([p.data for p in parts]).contiguous()
    return [QuantWeight(parts[0].format, (sum(p.shape[0] for p in parts), parts[0].shape[1]), data)]


class QuantLinear:
    """y = x W^T (+ b) with W in GGUF blocks, for layers.Linear's callers: [..., K] -> [..., N].

    Input of any float dtype and layout (made fp32 and row-contiguous); output fp32. Several
    parts (row blocks in different formats) run one kernel call each, into one output."""

    kernel = None  # the bf16 AMX kernel's packed weight: none here (model.kernels_enabled is off)

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None = None):
        self.parts = _stack(list(parts))
        self.in_features = self.parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in self.parts)
        self.bias = bias

    @property
    def formats(self) -> list[str]:
        return [p.format.name for p in self.parts]

    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or x2.stride(1) != 1:
            x2 = x2.float().contiguous()
        if len(self.parts) == 1:
            y = quant_linear(x2, self.parts[0])
        else:
            y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
            n0 = 0
            for p in self.parts:
                quant_linear(x2, p, out=y[:, n0 : n0 + p.shape[0]])
                n0 += p.shape[0]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.view(*lead, self.out_features)


class QuantEmbedding:
    """The token embedding table in GGUF blocks: `embed[ids]` -> [*ids.shape, hidden] fp32, the
    dequantized rows exactly (what LlamaModel.forward does with its fp32 table)."""

    def __init__(self, weight: QuantWeight):
        self.weight = weight
        self.shape = torch.Size(weight.shape)
        self.dtype = torch.float32
        self.device = torch.device("cpu")

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(ids)
        return quant_embedding(ids, self.weight).view(*ids.shape, self.shape[1])

    def nbytes(self) -> int:
        return self.weight.data.numel()


def read_quant_weights(gguf_path: Path | str, cfg) -> dict[str, QuantWeight]:
    """HF name -> QuantWeight for every 2-D Q8_0/Q4_0/Q4_1 tensor of the GGUF, Q/K rows
    unpermuted as the converter does. Unpermuted rows are a copy; the rest map the file."""
    import gguf

    out: dict[str, QuantWeight] = {}
    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        if int(t.tensor_type) not in FORMAT_BY_GGML_TYPE or len(t.shape) != 2:
            continue
        name = hf_tensor_name(t.name)
        w = quant_weight_from_gguf(t)
        heads = {"self_attn.q_proj.weight": cfg.num_attention_heads,
                 "self_attn.k_proj.weight": cfg.num_key_value_heads}.get(name.split(".", 3)[-1])
        if heads is not None:  # the converter's unpermute_rotary, on rows of blocks
            w = QuantWeight(w.format, w.shape, torch.from_numpy(unpermute_rotary(w.data.numpy(), heads)))
        out[name] = w
    return out


def _check_shape(name: str, qw: QuantWeight, want: tuple[int, int]) -> None:
    if tuple(qw.shape) != tuple(want):
        raise ValueError(f"GGUF tensor for {name} is {tuple(qw.shape)}, the model's is {tuple(want)}: not this model's GGUF")


def quantize_model_from_gguf(model, gguf_path: Path | str):
    """Swap `model`'s (an fp32 CPU LlamaModel of this GGUF) linears, embedding and head for
    quantized ones, in place; returns the model. Linears whose GGUF tensors are not all
    Q8_0/Q4_0/Q4_1 are left as they are. Sets `model.quantized` to {module name: formats}."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        raise ValueError(f"quantize_model_from_gguf needs an fp32 CPU model (this one is {model.dtype} on {model.device})")
    if getattr(model, "quantized", None):
        raise ValueError("this model is already quantized")
    cfg = model.cfg
    qw = read_quant_weights(gguf_path, cfg)
    plan: list[tuple[object, str, object, str]] = []  # (owner, attribute, replacement, name): checked, then applied
    for i, layer in enumerate(model.layers):
        for attr, names in _LAYER_LINEARS.items():
            full = [f"model.layers.{i}.{n}" for n in names]
            if not all(n in qw for n in full):
                continue
            old = getattr(layer, attr)
            parts = [qw[n] for n in full]
            if any(p.shape[1] != old.in_features for p in parts) or sum(p.shape[0] for p in parts) != old.out_features:
                raise ValueError(f"GGUF tensors {names} of layer {i} do not match the model's "
                                 f"[{old.out_features}, {old.in_features}]: not this model's GGUF")
            plan.append((layer, attr, QuantLinear(parts, old.bias), f"layers.{i}.{attr}"))
    if EMBED in qw:
        _check_shape("embed", qw[EMBED], tuple(model.embed.shape))
        plan.append((model, "embed", QuantEmbedding(qw[EMBED]), "embed"))
    head_name = EMBED if cfg.tie_word_embeddings else HEAD
    if head_name in qw:
        _check_shape("lm_head", qw[head_name], (model.lm_head.out_features, model.lm_head.in_features))
        plan.append((model, "lm_head", QuantLinear([qw[head_name]]), "lm_head"))
    model.kernels_enabled = False
    model.kernel_decoder = None
    for owner, attr, new, _ in plan:
        setattr(owner, attr, new)  # the fp32 weight it replaces goes with its last reference
    model.quantized = {name: [new.weight.format.name] if isinstance(new, QuantEmbedding) else new.formats
                       for _, _, new, name in plan}
    return model
