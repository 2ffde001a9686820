"""Convert a llama-architecture GGUF file into an ordinary Hugging Face model directory.

The engine has one loader, for HF directories (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json). A GGUF is converted once into such a directory and cached, so reading a
GGUF (~3 s of metadata parsing plus dequantization) happens once per machine, not per start.
The directory also holds the GGUF's tensor table (TENSOR_TABLE: name, type, shape and place of
every tensor), from which the quantized path maps the file's blocks without parsing its metadata
(gguf.GGUFReader spends ~2.8 s on SmolLM2's 100k vocabulary strings).

Weights are stored as float32. Dequantized Q4_1 values are d*q + m and Q8_0 values d*q, with d, m
in fp16 and q a 4- or 8-bit integer; those need up to ~24 significand bits, so neither bf16 nor fp16
holds them exactly (on SmolLM2-135M only 58% of the values survive an fp16 round trip). float32
holds every value `gguf.quants.dequantize` returns bit for bit, so the cache is exact and the
engine picks its own compute dtype at load time.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from agentrt.errors import ModelLoadError

# Bump when the output format changes: caches written by an older converter are then rebuilt.
CONVERTER_VERSION = 2
TENSOR_TABLE = "gguf_tensors.json"
CONVERSION_MARKER = "agentrt_conversion.json"  # written last; its presence means the directory is complete
WEIGHTS_FILE = "model.safetensors"

_GGUF_TYPE_CONTROL = 3  # llama.cpp token type CONTROL: <|im_start|>, <|endoftext|>, ...
_GGUF_TYPE_USER_DEFINED = 4

# GGUF per-layer tensor name -> HF name (Llama layout). Norms are F32; projections [out, in].
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Pre-tokenizer families (`tokenizer.ggml.pre`) we can rebuild. The StarCoder family (SmolLM's
# tokenizer) isolates each digit before the GPT-2 byte-level split, as llama.cpp does for it.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}
_PLAIN_BYTE_LEVEL_PRE = {None, "default", "gpt2", "gpt-2"}


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Llama equivalent (unsupported model variant)")


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (its rotary pairs (i, i + d/2) become adjacent rows).

    llama.cpp: w.reshape(n_heads, 2, d/2, in).swapaxes(1, 2); this is the inverse, as in
    transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    # [n_heads * head_dim, in] -> [n_heads, head_dim/2, 2, in] -> [n_heads, 2, head_dim/2, in]
    return np.ascontiguousarray(w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32(x: Any) -> float:
    """A GGUF float32 as the shortest decimal that rounds to it (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def hf_config_from_gguf(reader: Any, tensor_names: set[str]) -> dict[str, Any]:
    """config.json contents (LlamaForCausalLM) from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (supported: 'llama')")

    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata {arch}.{key} is missing")
        return value

    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    rope_dim = int(meta("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(f"GGUF rope.dimension_count {rope_dim} != head dim {head_dim}: partial rotary is not supported")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {scaling!r} is not supported")
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta("vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def build_gguf_tokenizer(reader: Any) -> tuple[Any, dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config dict) from the GGUF's byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer model {model!r} is not supported (supported: byte-level BPE 'gpt2')")
    pre = _field(reader, "tokenizer.ggml.pre")
    if pre not in _DIGIT_SPLIT_PRE | _PLAIN_BYTE_LEVEL_PRE:
        raise ModelLoadError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {sorted(str(p) for p in _DIGIT_SPLIT_PRE | _PLAIN_BYTE_LEVEL_PRE)})"
        )
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    types: list[int] = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError("GGUF tokenizer has duplicate tokens")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # Special tokens already have ids in the vocabulary; adding them makes the tokenizer match them
    # whole in text (chat markup) and lets decode(skip_special_tokens=True) drop them.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _GGUF_TYPE_CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _GGUF_TYPE_USER_DEFINED]
    )

    def token_at(key: str) -> str | None:
        i = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab[bos])]
        )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, f"{_field(reader, 'general.architecture')}.context_length", 2048)),
    }
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        tokenizer_config["chat_template"] = template
    return tok, tokenizer_config


def dequantized_tensors(reader: Any, config: dict[str, Any], on_tensor: Any = None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) for every tensor, with llama.cpp's Q/K row permutation undone."""
    from gguf.quants import dequantize

    n_heads, n_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims innermost-first
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_rotary(w, n_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_rotary(w, n_kv_heads)
        if on_tensor is not None:
            on_tensor(t.name)
        yield name, np.ascontiguousarray(w)


def tensor_table(reader: Any) -> dict[str, Any]:
    """Where each tensor of a GGUFReader's file lies: what models/quantized.py maps them by."""
    return {"data_offset": int(reader.data_offset), "tensors": [
        {"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in t.shape], "offset": int(t.data_offset),
         "n_bytes": int(t.n_bytes)} for t in reader.tensors]}


def conversion_marker(gguf_path: Path, weights: bool = True) -> dict[str, Any]:
    return {
        "converter_version": CONVERTER_VERSION,
        "source": Path(gguf_path).name,
        "source_size": Path(gguf_path).stat().st_size,
        "source_mtime_ns": Path(gguf_path).stat().st_mtime_ns,  # a file replaced in place is converted again
        "dtype": "float32",
        "weights": weights,
    }


def conversion_is_current(out_dir: Path, gguf_path: Path | None, weights: bool = True) -> bool:
    """Whether out_dir is a complete conversion (of gguf_path, when given) by this converter
    version; with weights=False, one with or without the dequantized weights."""
    try:
        marker = json.loads((Path(out_dir) / CONVERSION_MARKER).read_text())
    except (OSError, ValueError):
        return False
    has_weights = marker.pop("weights", True)  # markers older than the option always had them
    if marker.get("converter_version") != CONVERTER_VERSION or (weights and not has_weights):
        return False
    if gguf_path is not None:
        want = conversion_marker(gguf_path)
        want.pop("weights")
        if marker != want:
            return False
    needed = ("config.json", "tokenizer.json", "tokenizer_config.json", TENSOR_TABLE) + ((WEIGHTS_FILE,) if has_weights else ())
    return all((Path(out_dir) / f).is_file() for f in needed)


@contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Any]:
    """Yields advance(description) -> None; a rich progress bar on stderr when enabled."""
    if not enabled:
        yield lambda description=None: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("reading GGUF", total=total)

        def advance(description: str | None = None) -> None:
            bar.update(task, advance=1, description=description or bar.tasks[0].description)

        yield advance


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _install(tmp: Path, out_dir: Path, weights: bool = True) -> None:
    """Move a finished tmp directory to out_dir. Readers see the old complete directory, none, or the
    new complete one: never a partial one (the marker inside is checked as well)."""
    if out_dir.exists():
        trash = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out_dir, trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        # Another process installed its conversion in between; keep theirs if it is complete.
        if not conversion_is_current(out_dir, None, weights):
            raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(out_dir: Path) -> list[Path]:
    """Delete partial conversions of out_dir left by killed processes (their pid is in the name),
    and replaced conversions a killed process did not finish deleting."""
    removed = list(out_dir.parent.glob(f".{out_dir.name}.old-*"))
    for old in removed:
        shutil.rmtree(old, ignore_errors=True)
    for partial in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
        pid = partial.name.rsplit(".partial-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)
            removed.append(partial)
    return removed


def convert_gguf(gguf_path: Path | str, out_dir: Path | str, progress: bool = True, weights: bool = True) -> Path:
    """Convert gguf_path into the HF directory out_dir (replaced if present). Returns out_dir.
    weights=False writes the configuration and tokenizer only (for the quantized path, which
    reads the tensors from the GGUF itself)."""
    import gguf
    from safetensors.numpy import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ModelLoadError(f"{gguf_path}: GGUF file not found")
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # noqa: BLE001 - the gguf package raises plain ValueError/struct errors
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF file ({e})") from None
    names = {t.name for t in reader.tensors}
    config = hf_config_from_gguf(reader, names)
    tokenizer, tokenizer_config = build_gguf_tokenizer(reader)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        if weights:
            with _progress(progress, total=len(reader.tensors) + 1) as advance:
                tensors = dict(dequantized_tensors(reader, config, on_tensor=lambda n: advance(f"dequantizing {n}")))
                advance(f"writing {WEIGHTS_FILE}")
                save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            del tensors
        _write_json(tmp / "config.json", config)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        _write_json(tmp / TENSOR_TABLE, tensor_table(reader))
        _write_json(tmp / CONVERSION_MARKER, conversion_marker(gguf_path, weights))
        _install(tmp, out_dir, weights)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
