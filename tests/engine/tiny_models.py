"""Tiny random models, saved as complete HF directories (or a GGUF), for fast engine tests.

Every variant: 2 layers, hidden 64, 4 heads, 2 KV heads, intermediate 128, float32, and a small
byte-level BPE tokenizer (4 special tokens + 256 bytes + a few merges) with a chat template.
Weights are drawn with std 0.1 (not HF's 0.02) so logits are peaked enough that greedy argmax is
not decided by rounding noise.

| variant | class   | particulars                                                        |
|---------|---------|--------------------------------------------------------------------|
| llama2  | Llama   | untied, theta 1e4, BOS added by the tokenizer, [INST] template      |
|         |         | that raises on non-alternating roles                                |
| llama3  | Llama   | llama3 rope_scaling (factor 8, original context 64), theta 5e5,     |
|         |         | two eos ids, tools-aware ChatML template                            |
| smollm  | Llama   | tied embeddings, theta 1e5, ChatML template (like SmolLM2)          |
| mistral | Mistral | head_dim 32 != hidden/heads (q_size 128), theta 1e6, [INST] template|
| qwen2   | Qwen2   | q/k/v biases, embedding rows padded to 320 > tokenizer vocab,       |
|         |         | tools-aware ChatML template                                         |

FAMILY_VARIANTS, the later families on the same tokenizer (their norm weights drawn at random
too, so a norm applied wrong shows):

| variant | class   | particulars                                                        |
|---------|---------|--------------------------------------------------------------------|
| qwen3   | Qwen3   | QK-norm, no biases, head_dim 32 given explicitly, ChatML template   |
| gemma3  | Gemma3  | 3 layers (sliding, full, sliding; window 6), head_dim 32, local     |
|         | (text)  | theta 1e4, global theta 1e6 with linear scaling 2, query scalar 24, |
|         |         | logit soft-capping 30, tied embeddings, ChatML template             |
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VARIANTS = ("llama2", "llama3", "smollm", "mistral", "qwen2")
FAMILY_VARIANTS = ("qwen3", "gemma3")
SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")  # ids 0..3
_MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("Ġ", "a"), ("o", "n"), ("r", "e"),
    ("a", "t"), ("e", "n"), ("Ġ", "s"), ("Ġ", "w"), ("o", "r"), ("e", "s"), ("i", "s"), ("l", "l"),
    ("Ġ", "c"), ("Ġ", "f"), ("Ġ", "o"), ("Ġ", "b"), ("a", "n"), ("i", "t"), ("Ġ", "p"), ("o", "u"),
    ("e", "d"), ("in", "g"), ("Ġ", "h"), ("Ġ", "d"), ("l", "e"), ("Ġ", "i"), ("Ġ", "m"), ("a", "r"),
    ("Ġ", "\""), ("\"", ":"), ("Ġ", "{"), ("Ċ", "Ċ"), ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("u", "s"), ("e", "l"),
]

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
INST_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'].strip() + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'].strip() + eos_token }}{% endif %}{% endfor %}"
)
TOOLS_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a tiny test model.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call functions. Signatures within <tools></tools>:\\n<tools>" }}
{%- for tool in tools %}
{{- "\\n" }}{{- tool | tojson }}
{%- endfor %}
{{- "\\n</tools>\\n\\nReturn each call as <tool_call>{\\"name\\": ..., \\"arguments\\": ...}</tool_call><|im_end|>\\n" }}
{%- elif messages[0]['role'] != 'system' %}
{{- '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}
{%- if not tools %}{{- '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}
{%- elif message['role'] == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}
{%- for call in message.get('tool_calls', []) %}
{{- '\\n<tool_call>\\n' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson) + '\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel pre-tokenization produces)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def tiny_vocab() -> tuple[list[str], list[tuple[str, str]]]:
    """(tokens in id order, merges): 4 special tokens, the 256 byte tokens, one token per merge."""
    tokens = list(SPECIAL_TOKENS) + [_bytes_to_unicode()[b] for b in range(256)]
    for a, b in _MERGES:
        assert a in tokens and b in tokens, (a, b)
        tokens.append(a + b)
    return tokens, list(_MERGES)


def build_tiny_tokenizer(add_bos: bool):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens, merges = tiny_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 0)])
    return tok


_VARIANT_SPECS = {
    # variant: (config class, config kwargs, tokenizer bos, eos, template, add_bos)
    "llama2": ("LlamaConfig", dict(rope_theta=10000.0, bos_token_id=0, eos_token_id=1), "<s>", "</s>", INST_TEMPLATE, True),
    "llama3": ("LlamaConfig", dict(
        rope_theta=500000.0, bos_token_id=0, eos_token_id=[1, 3], max_position_embeddings=256,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    ), "<s>", "<|im_end|>", TOOLS_TEMPLATE, True),
    "smollm": ("LlamaConfig", dict(rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=2, eos_token_id=3),
               "<|im_start|>", "<|im_end|>", CHATML_TEMPLATE, False),
    "mistral": ("MistralConfig", dict(rope_theta=1000000.0, head_dim=32, sliding_window=None, bos_token_id=0, eos_token_id=1),
                "<s>", "</s>", INST_TEMPLATE, True),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0, bos_token_id=None, eos_token_id=1, vocab_size=320),
              None, "<|im_end|>", TOOLS_TEMPLATE, False),
    "qwen3": ("Qwen3Config", dict(rope_theta=1000000.0, head_dim=32, bos_token_id=None, eos_token_id=3),
              None, "<|im_end|>", CHATML_TEMPLATE, False),
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, head_dim=32, sliding_window=6, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
        bos_token_id=2, eos_token_id=3, pad_token_id=3,
    ), "<|im_start|>", "<|im_end|>", CHATML_TEMPLATE, False),
}


def save_tiny_model(path: Path | str, variant: str, seed: int = 0) -> Path:
    """Write a complete tiny HF model directory for `variant` (see VARIANTS) into path."""
    import torch
    import transformers

    if variant not in _VARIANT_SPECS:
        raise ValueError(f"unknown tiny variant {variant!r}; choose from {VARIANTS}")
    cls_name, extra, bos, eos, template, add_bos = _VARIANT_SPECS[variant]
    tokens, _ = tiny_vocab()
    kwargs = dict(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
        tie_word_embeddings=False,
    )
    kwargs.update(extra)
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if variant in FAMILY_VARIANTS:  # HF initializes norms to the identity (ones, or zeros for Gemma's 1 + w)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn(p.shape) * 0.3)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    build_tiny_tokenizer(add_bos).save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": eos,
        "add_bos_token": add_bos, "clean_up_tokenization_spaces": False, "model_max_length": kwargs["max_position_embeddings"],
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `permute` of Q/K rows, for writing a GGUF as llama.cpp does."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_ARCH = {"smollm": "llama", "llama3": "llama", "qwen3": "qwen3", "gemma3": "gemma3"}


def _llama3_rope_freqs(cfg: dict) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for a Llama 3 rope_scaling (convert_hf_to_gguf's formula)."""
    rs = cfg.get("rope_parameters") or cfg["rope_scaling"]
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / rs["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d)
    low_wavelen = rs["original_max_position_embeddings"] / rs["low_freq_factor"]
    high_wavelen = rs["original_max_position_embeddings"] / rs["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(rs["factor"])
        else:
            smooth = (rs["original_max_position_embeddings"] / wavelen - rs["low_freq_factor"]) / (
                rs["high_freq_factor"] - rs["low_freq_factor"])
            out.append(1 / ((1 - smooth) / rs["factor"] + smooth))
    return np.asarray(out, dtype=np.float32)


def save_tiny_gguf(path: Path | str, seed: int = 0, hf_dir: Path | None = None, variant: str = "smollm",
                   projections: str = "Q4_1") -> Path:
    """Write a tiny model (`variant`: smollm, llama3, qwen3 or gemma3) as a GGUF the way llama.cpp
    does: Llama's Q/K rows permuted, Gemma's norms stored as 1 + weight, Llama 3's rope scaling as
    a rope_freqs tensor, projections in `projections` (a GGML type name: Q4_1, Q8_0, F32),
    embeddings Q8_0 (F32 with F32 projections), norms F32, the tokenizer's vocab/merges/types and
    chat template in metadata (the smollm tokenizer settings for every variant).
    hf_dir: where to save the source HF model (kept for comparisons); a sibling dir by default."""
    import gguf
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    path = Path(path)
    hf_dir = Path(hf_dir) if hf_dir is not None else path.with_suffix(".hf")
    save_tiny_model(hf_dir, variant, seed=seed)
    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = load_file(str(hf_dir / "model.safetensors"))
    tokens, merges = tiny_vocab()
    arch = _GGUF_ARCH[variant]
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta")}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{variant}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"] if arch == "gemma3" else rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(len(tokens))
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        w.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(2)
    w.add_eos_token_id(3)
    w.add_pad_token_id(3)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {
        "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    }
    if arch == "gemma3":
        layer_names |= {"post_attention_layernorm.weight": "post_attention_norm.weight",
                        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                        "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
    qtype = getattr(gguf.GGMLQuantizationType, projections)
    F32 = gguf.GGMLQuantizationType.F32
    for hf_name, t in sd.items():
        if hf_name in names:
            name = names[hf_name]
        else:
            _, _, layer, rest = hf_name.split(".", 3)
            name = f"blk.{layer}.{layer_names[rest]}"
        if arch == "llama" and name.endswith("attn_q.weight"):
            t = _llama_cpp_permute(t, n_heads)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            t = _llama_cpp_permute(t, n_kv)
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + np.float32(1.0)
        tt = F32 if t.ndim == 1 else gguf.GGMLQuantizationType.Q8_0 if name == "token_embd.weight" and qtype != F32 else qtype
        data = t.astype(np.float32) if tt == F32 else quantize(t.astype(np.float32), tt)
        w.add_tensor(name, data, raw_dtype=None if tt == F32 else tt)
    if variant == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
