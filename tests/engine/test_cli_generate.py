"""`agentrt generate` end to end in a subprocess, on a tiny model directory."""
from __future__ import annotations

import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrt.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_streams_text_and_prints_alpha(tiny_model_dir):
    path = str(tiny_model_dir("smollm"))
    p = _run("generate", "one two one two one two", "--model", path, "--max-tokens", "24", "--temperature", "0",
             "--dtype", "float32", "--raw", "--spec", "suffix", "--k", "4")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip()  # the streamed text
    assert f"model: {path} (float32; cpu)" in p.stderr  # a float model's precision, plainly; never on stdout
    assert "speculation" in p.stderr and "tokens/pass" in p.stderr and "suffix" in p.stderr


def test_generate_reports_bad_input_without_a_traceback(tiny_model_dir):
    p = _run("generate", "hi", "--model", str(tiny_model_dir("smollm")), "--max-tokens", "0")
    assert p.returncode == 2 and "max_tokens" in p.stderr and "Traceback" not in p.stderr
    p = _run("generate", "hi", "--model", "no-such-model")
    assert p.returncode == 2 and "smollm2-135m-instruct" in p.stderr  # lists the known models
