"""Convert a GGUF file (architectures llama, qwen3, gemma3) into an ordinary Hugging Face model
directory.

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

from agentrt.engine.loading.gguf_tokenizer import build_gguf_tokenizer
from agentrt.engine.loading.gguf_tokenizer import gguf_field as _field
from agentrt.errors import ModelLoadError

# Bump when the output format changes: caches written by an older converter are then rebuilt.
CONVERTER_VERSION = 2
TENSOR_TABLE = "gguf_tensors.json"
CONVERSION_MARKER = "agentrt_conversion.json"  # written last; its presence means the directory is complete
WEIGHTS_FILE = "model.safetensors"


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
_QK_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
# Gemma 3: ffn_norm is the MLP's input norm (HF pre_feedforward_layernorm); the attention and MLP
# outputs have norms of their own
_GEMMA3_NAMES = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                 "post_attention_norm.weight": "post_attention_layernorm.weight",
                 "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_LAYER_NAMES_BY_ARCH = {"llama": _LAYER_NAMES, "qwen3": _LAYER_NAMES | _QK_NORM_NAMES,
                        "gemma3": _LAYER_NAMES | _QK_NORM_NAMES | _GEMMA3_NAMES}
_HF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen3": ("Qwen3ForCausalLM", "qwen3"),
                     "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}
# Read into the configuration, not weights: Llama 3.x's per-frequency rotary divisors
ROPE_FREQS = "rope_freqs.weight"
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """The HF name of a GGUF tensor of a model of architecture `arch` (GGUF's spelling; ModelConfig's
    families llama/mistral/qwen2 all read as "llama")."""
    layer_names = _LAYER_NAMES_BY_ARCH.get(arch, _LAYER_NAMES)
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no {arch} equivalent (unsupported model variant)")


def hf_float_tensor(hf_name: str, w: np.ndarray, arch: str, n_heads: int, n_kv_heads: int) -> np.ndarray:
    """A GGUF tensor's values as the HF checkpoint holds them: llama.cpp permuted Llama's Q/K rows
    for its interleaved rotary (Qwen3 and Gemma 3 use the rotate-half layout, unpermuted), and
    stored Gemma's norms with the 1 of its (1 + weight) scaling added."""
    if arch == "llama" and hf_name.endswith("self_attn.q_proj.weight"):
        return unpermute_rotary(w, n_heads)
    if arch == "llama" and hf_name.endswith("self_attn.k_proj.weight"):
        return unpermute_rotary(w, n_kv_heads)
    if arch == "gemma3" and hf_name.endswith("norm.weight"):
        return w - np.float32(1.0)
    return w


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (its rotary pairs (i, i + d/2) become adjacent rows).

    llama.cpp: w.reshape(n_heads, 2, d/2, in).swapaxes(1, 2); this is the inverse, as in
    transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    # [n_heads * head_dim, in] -> [n_heads, head_dim/2, 2, in] -> [n_heads, 2, head_dim/2, in]
    return np.ascontiguousarray(w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _f32(x: Any) -> float:
    """A GGUF float32 as the shortest decimal that rounds to it (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def hf_config_from_gguf(reader: Any, tensor_names: set[str]) -> dict[str, Any]:
    """config.json contents (LlamaForCausalLM, Qwen3ForCausalLM or Gemma3ForCausalLM) from the GGUF
    metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _HF_ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(_HF_ARCHITECTURES)})")

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
    theta = _f32(meta("rope.freq_base", 10000.0))
    context = int(meta("context_length", 2048))
    scaling = _rope_scaling(reader, arch, theta, head_dim)
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    hf_arch, model_type = _HF_ARCHITECTURES[arch]
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(meta("vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": context,
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "gemma3":
        config |= _gemma3_config(reader, meta, config)
        if "<end_of_turn>" in tokens and eos is not None:  # what its chat turns end with (llama.cpp stops there too)
            config["eos_token_id"] = [eos, list(tokens).index("<end_of_turn>")]
    return config


def _gemma3_config(reader: Any, meta: Any, config: dict[str, Any]) -> dict[str, Any]:
    """What a Gemma 3 GGUF adds, read as llama.cpp reads it: the sliding layers' pattern (the
    metadata's, else every 6th layer global), their rotary base (10000, fixed in llama.cpp), the
    attention scale (`attention.scale` if given, else llama.cpp's rule: head_dim ** -0.5, the
    27B model's hidden / heads)."""
    layers = config["num_hidden_layers"]
    pattern = _field(reader, "gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
        if len(sliding) != layers:
            raise ModelLoadError(f"GGUF gemma3.attention.sliding_window_pattern lists {len(sliding)} layers, not {layers}")
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(layers)]
    scale = _field(reader, "gemma3.attention.scale")
    if scale is not None:
        scalar = float(scale) ** -2
    else:
        scalar = config["hidden_size"] / config["num_attention_heads"] if layers == 62 else config["head_dim"]
    softcap = _field(reader, "gemma3.final_logit_softcapping")
    full = {"rope_type": "default", "rope_theta": config["rope_theta"]} | (config["rope_scaling"] or {})
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": round(scalar, 4),
        "sliding_window": int(meta("attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_parameters": {"full_attention": full,
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        "rope_scaling": None,
        "final_logit_softcapping": _f32(softcap) if softcap is not None else None,
    }


def _rope_scaling(reader: Any, arch: str, theta: float, head_dim: int) -> dict[str, Any] | None:
    """The HF rope_scaling of a GGUF: "linear" from rope.scaling.type/factor, or Llama 3's, which
    llama.cpp stores as a rope_freqs tensor (each frequency's divisor, not its parameters)."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    if kind not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported (supported: linear, llama3 rope_freqs)")
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is None:
        return None
    return llama3_scaling_from_factors(np.asarray(freqs.data, dtype=np.float64).reshape(-1), theta, head_dim)


def llama3_scaling_from_factors(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """Llama 3 rope_scaling parameters that reproduce llama.cpp's per-frequency divisors.

    For a frequency of wavelength w the divisor is 1 (w < original / high_freq_factor), `factor`
    (w > original / low_freq_factor), or in between 1 / ((1 - s) / factor + s) with
    s = (original / w - low) / (high - low), linear in 1 / w: 1 at the shortest wavelength that is
    not scaled, 0 at the longest fully scaled one. The frequencies in between fix that line (any
    two do); with fewer, a line through them and the longest fully scaled (s = 0) or the shortest
    unscaled (s = 1) frequency that keeps the others on their sides gives the same divisors at the
    model's frequencies. The line fixes the curve for any `original`; 8192 (every Llama 3.x) is kept."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != inv_freq.shape:
        raise ModelLoadError(f"GGUF {ROPE_FREQS} has {factors.size} values, expected head_dim / 2 = {inv_freq.size}")
    x = inv_freq / (2 * np.pi)  # 1 / wavelength
    factor = float(factors.max())
    if factor <= 1:
        raise ModelLoadError(f"GGUF {ROPE_FREQS} scales no frequency (all divisors <= 1)")
    ones, scaled = factors <= 1 + 1e-6, factors >= factor * (1 - 1e-6)
    between = ~ones & ~scaled
    xs, ss = list(x[between]), list((1 / factors[between] - 1 / factor) / (1 - 1 / factor))
    anchors = [([x[scaled].max()], [0.0])] if scaled.any() else []
    anchors += [([x[ones].min()], [1.0])] if ones.any() else []
    candidates = [(xs, ss)] + [(xs + ax, ss + a_s) for ax, a_s in anchors]
    if len(anchors) == 2:
        candidates.append((xs + anchors[0][0] + anchors[1][0], ss + [0.0, 1.0]))
    original, worst = 8192, np.inf
    for cx, cs in candidates:
        if len(cx) < 2:
            continue
        a, b = np.polyfit(np.asarray(cx), np.asarray(cs), 1)  # a = original / (high - low), b = -low / (high - low)
        low = -b * original / a
        high = low + original / a
        if not (a > 0 and 0 < low < high):
            continue
        smooth = (original * x - low) / (high - low)
        got = np.where(x > high / original, 1.0, np.where(x < low / original, factor, 1 / ((1 - smooth) / factor + smooth)))
        worst = min(worst, float(np.abs(got / factors - 1).max()))
        if np.allclose(got, factors, rtol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low), "high_freq_factor": float(high),
                    "original_max_position_embeddings": original}
    raise ModelLoadError(f"GGUF {ROPE_FREQS} does not follow Llama 3's rope scaling (closest fit off by {worst:.2g}); "
                         "other rotary frequency factors are not supported")


def dequantized_tensors(reader: Any, config: dict[str, Any], on_tensor: Any = None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) for every tensor, as the HF checkpoint holds it (hf_float_tensor)."""
    from gguf.quants import dequantize

    arch = _field(reader, "general.architecture")
    n_heads, n_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # in the configuration (rope_scaling)
            continue
        name = hf_tensor_name(t.name, arch)
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims innermost-first
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        w = hf_float_tensor(name, w, arch, n_heads, n_kv_heads)
        if on_tensor is not None:
            on_tensor(t.name)
        yield name, np.ascontiguousarray(w)


def tensor_table(reader: Any) -> dict[str, Any]:
    """Where each tensor of a GGUFReader's file lies: what quantized.py maps them by."""
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
