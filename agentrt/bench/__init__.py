"""Benchmarks: `agentrt bench NAME [--quick] [--json PATH]`. Each compares side by side in one run."""
