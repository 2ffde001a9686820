"""Load an HF directory's safetensors into a state dict in HF names, checked against the config."""
from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path

import torch

from agentrt.engine.config import ModelConfig
from agentrt.engine.loading.registry import weight_files
from agentrt.errors import ModelLoadError

# Tensors some checkpoints carry that no model needs (old Llama checkpoints saved the RoPE table).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, HF name -> shape. No lm_head.weight when embeddings are tied."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if config.attention_bias:  # Qwen2: q/k/v biases, none on o_proj
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if config.qk_norm:  # Qwen3, Gemma 3: one norm over each head's q, one over k
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
        if config.gemma_norms:  # the MLP's input norm and the norm of its output
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    return shapes


def check_tensor_set(source: Path | str, shapes: dict[str, tuple[int, ...]], config: ModelConfig,
                     file_of=None) -> None:
    """A checkpoint's tensors (name -> shape) hold every tensor expected_shapes(config) lists,
    with that shape, and no other (except ignorable ones, and lm_head.weight of a tied model): a
    checkpoint with extra tensors belongs to a model variant our code would silently run wrong.
    Errors name `source`, or file_of(name) for a tensor's own file."""
    file_of = file_of or (lambda name: source)
    expected = expected_shapes(config)
    missing = [n for n in expected if n not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{source}: missing tensor {missing[0]!r}{more} for a {config.architecture} model")
    unexpected = [n for n in shapes if n not in expected and not _IGNORED.search(n)
                  and not (n == "lm_head.weight" and config.tie_word_embeddings)]
    if unexpected:
        raise ModelLoadError(f"{file_of(unexpected[0])}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in "
                             f"all); not part of a {config.architecture} model with this config.json")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ModelLoadError(f"{file_of(name)}: tensor {name!r} has shape {list(shapes[name])}, "
                                 f"config.json implies {list(shape)}")


def _open(stack: ExitStack, file: Path):
    from safetensors import safe_open

    try:
        return stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
    except Exception as e:  # noqa: BLE001 - SafetensorError and OSError both mean the same to the user
        raise ModelLoadError(f"{file}: cannot read safetensors file, truncated or corrupt? ({e})") from None


def load_state_dict(
    path: Path, config: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Tensors of the HF directory `path` in HF names, cast to dtype on device.

    The tensor set is checked by check_tensor_set; a tied model's lm_head.weight is dropped.
    """
    path = Path(path)
    expected = expected_shapes(config)
    state: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        where: dict[str, tuple[Path, object]] = {}  # tensor name -> (file, open handle)
        for file in weight_files(path):
            handle = _open(stack, file)
            for name in handle.keys():
                if name in where:
                    raise ModelLoadError(f"{path}: tensor {name!r} is in both {where[name][0].name} and {file.name}")
                where[name] = (file, handle)

        check_tensor_set(path, {n: tuple(h.get_slice(n).get_shape()) for n, (_, h) in where.items()}, config,
                         lambda name: where[name][0])
        for name in expected:
            file, handle = where[name]
            try:
                tensor = handle.get_tensor(name)
            except Exception as e:  # noqa: BLE001
                raise ModelLoadError(f"{file}: cannot read tensor {name!r} ({e})") from None
            if not tensor.is_floating_point():
                raise ModelLoadError(f"{file}: tensor {name!r} has dtype {tensor.dtype}; quantized checkpoints are not supported")
            state[name] = tensor.to(device=device, dtype=dtype)
    return state
