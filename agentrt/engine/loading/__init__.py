"""A model name or path -> a ready model and tokenizer (model_loader.py): known names resolved to
HF-style directories (registry.py), a GGUF converted once into one (gguf_convert.py, its tokenizer
rebuilt by gguf_tokenizer.py and gguf_spm_tokenizer.py) or run on its quantized blocks mapped from
the file (quantized.py), safetensors checked against the config (weights.py)."""
