"""Our float model with llama.cpp's activation rounding, to tell apart what the model computes
from what llama.cpp's CPU matmuls round.

ggml multiplies a quantized weight by activations quantized to the weight type's vec_dot_type
(ggml-cpu's type_traits_cpu): Q4_0, Q5_0, Q8_0 and IQ4_NL weights take Q8_0 activations (32-value
blocks, an fp16 scale d = amax / 127), Q4_1 and Q5_1 take Q8_1 (the same quants, plus the block's
sum for the weight's offset), the K-quants (Q2_K..Q6_K, IQ4_XS) take Q8_K (256-value blocks, a
float scale from the signed value of largest magnitude: quantize_row_q8_K_ref); an F16 or BF16
weight takes its own type, an F32 weight the activations as they are. Its dot products are then
exact integer sums times the block scales, so a matmul equals the dequantized weight times the
rounded-and-dequantized activations (up to fp32 summation order): that is what `rounded` computes.

`rounding_model(name)` is the model dequantized to fp32 (the conversion `agentrt bench decode`'s
dequantized fp32 path runs) with each linear's input rounded so, per weight tensor, the types
read from the GGUF's tensor table; the tied output head rounds as its embedding's type. Not
emulated: a Q8_1 block sum stored in fp16 (ggml multiplies a Q4_1/Q5_1 offset by it), the
attention (in fp32 here; llama.cpp keeps K/V in f16 by default), and summation order.
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

QK8_0 = 32  # Q8_0 / Q8_1 activation block
QK_K = 256  # Q8_K activation block

# ggml weight type -> the activation type its vec_dot takes (ggml-cpu.c, type_traits_cpu[].vec_dot_type)
VEC_DOT_TYPE = {
    "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "IQ4_NL": "Q8_0",
    "Q4_1": "Q8_1", "Q5_1": "Q8_1",
    "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K", "IQ4_XS": "Q8_K",
    "F16": "F16", "BF16": "BF16", "F32": "F32",
}


def _blocks(x: torch.Tensor, size: int, what: str) -> torch.Tensor:
    """x [..., K] as fp32 blocks [..., K / size, size]; K not a multiple of size is refused (ggml asserts it)."""
    k = x.shape[-1]
    if k % size:
        raise ValueError(f"{what} rounds rows in blocks of {size} values; a row of {k} is not a whole number of blocks")
    return x.float().reshape(*x.shape[:-1], k // size, size)


def round_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x rounded as ggml's x86 quantize_row_q8_0 stores it, dequantized: per 32 values
    q = round-half-even(x * 127 / amax), d = fp16(amax / 127), x' = q * d. Also Q8_1's quants."""
    b = _blocks(x, QK8_0, "Q8_0")
    amax = b.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    d = (amax / 127.0).half().float()
    return (torch.round(b * inv) * d).reshape(x.shape)


def round_q8_k(x: torch.Tensor) -> torch.Tensor:
    """x rounded as ggml's quantize_row_q8_K_ref stores it, dequantized: per 256 values, max = the
    signed value of largest magnitude, iscale = -127 / max,
    q = min(127, round-half-even(iscale * x)), d = 1 / iscale (a float), x' = q * d."""
    b = _blocks(x, QK_K, "Q8_K")
    idx = b.abs().argmax(dim=-1, keepdim=True)  # of +m and -m either gives the same q * d (both flip sign)
    mx = b.gather(-1, idx)
    nz = mx != 0
    iscale = torch.where(nz, -127.0 / torch.where(nz, mx, torch.ones_like(mx)), torch.zeros_like(mx))
    q = torch.round(iscale * b).clamp(max=127.0)
    d = torch.where(nz, 1.0 / torch.where(nz, iscale, torch.ones_like(iscale)), torch.zeros_like(iscale))
    return (q * d).reshape(x.shape)


def rounded(x: torch.Tensor, activation_type: str) -> torch.Tensor:
    """x as ggml's matmul sees it for weights whose vec_dot_type is activation_type (fp32 out)."""
    if activation_type in ("Q8_0", "Q8_1"):
        return round_q8_0(x)
    if activation_type == "Q8_K":
        return round_q8_k(x)
    if activation_type == "F16":
        return x.half().float()
    if activation_type == "BF16":
        return x.bfloat16().float()
    if activation_type == "F32":
        return x.float()
    raise ValueError(f"no activation rounding for {activation_type!r}")


def activation_type(ggml_type: str) -> str:
    if ggml_type not in VEC_DOT_TYPE:
        raise ValueError(f"ggml type {ggml_type} has no activation rounding here (known: {', '.join(VEC_DOT_TYPE)})")
    return VEC_DOT_TYPE[ggml_type]


class RoundingLinear:
    """A layers.Linear whose row blocks (q, k, v; gate, up) each see x rounded for their weight's
    ggml type, as llama.cpp runs each of them as a matmul of its own."""

    def __init__(self, linear, parts: list[tuple[int, str]]):
        # parts: (rows, ggml type) in the order the linear stacks its weights
        if sum(r for r, _ in parts) != linear.out_features:
            raise ValueError(f"row blocks {parts} do not add up to the linear's {linear.out_features} rows")
        self.linear, self.bias = linear, linear.bias
        self.out_features, self.in_features = linear.out_features, linear.in_features
        self.parts = [(r, activation_type(t)) for r, t in parts]

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, outs, row, cache = self.linear.weight.float(), [], 0, {}
        for rows, act in self.parts:
            if act not in cache:
                cache[act] = rounded(x, act)
            outs.append(F.linear(cache[act], w[row: row + rows]))
            row += rows
        y = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)


def tensor_types(source) -> dict[str, str]:
    """HF tensor name -> its ggml type name, from the GGUF's cached tensor table."""
    from gguf import GGMLQuantizationType

    from agentrt.engine.loading.gguf_convert import ROPE_FREQS, TENSOR_TABLE, hf_tensor_name
    from agentrt.engine.loading.quantized import gguf_arch

    table = json.loads((source.path / TENSOR_TABLE).read_text())
    arch = gguf_arch(source.config)
    return {hf_tensor_name(e["name"], arch): GGMLQuantizationType(e["type"]).name
            for e in table["tensors"] if e["name"] != ROPE_FREQS}


def patch_model(model, types: dict[str, str]) -> None:
    """Each linear of `model` (a float LlamaModel on the PyTorch path) replaced by a RoundingLinear
    with the row blocks and ggml types of its GGUF tensors."""
    cfg = model.cfg
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        mlp = layer.gate_up.out_features // 2
        layer.qkv = RoundingLinear(layer.qkv, [(nq * d, types[p + "self_attn.q_proj.weight"]),
                                               (nkv * d, types[p + "self_attn.k_proj.weight"]),
                                               (nkv * d, types[p + "self_attn.v_proj.weight"])])
        layer.o = RoundingLinear(layer.o, [(layer.o.out_features, types[p + "self_attn.o_proj.weight"])])
        layer.gate_up = RoundingLinear(layer.gate_up, [(mlp, types[p + "mlp.gate_proj.weight"]),
                                                       (mlp, types[p + "mlp.up_proj.weight"])])
        layer.down = RoundingLinear(layer.down, [(layer.down.out_features, types[p + "mlp.down_proj.weight"])])
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    model.lm_head = RoundingLinear(model.lm_head, [(model.lm_head.out_features, types[head])])


def rounding_model(name: str):
    """(the model `name` dequantized to fp32 with llama.cpp's activation rounding, its tokenizer)."""
    from agentrt.engine.chat.tokenizer import Tokenizer
    from agentrt.engine.loading.registry import resolve_model
    from agentrt.engine.loading.weights import load_state_dict
    from agentrt.engine.models.llama import LlamaModel

    source = resolve_model(name, progress=False)
    if source.gguf is None:
        raise ValueError(f"{name} is not a GGUF model: there is no llama.cpp rounding to emulate")
    sd = load_state_dict(source.path, source.config, torch.float32, "cpu")
    model = LlamaModel(source.config, sd, use_kernels=False)
    patch_model(model, tensor_types(source))
    return model, Tokenizer.from_dir(source.path)
