"""Structured outputs: response formats and their JSON schemas (output_format.py, schema_finite.py), and
each model family's tool-call format (tool_formats.py: prompt and grammar of a call turn; tool_parse.py:
calls read back from any output). The engine constrains generation to them; the runtime and the
server render prompts with them and read calls back."""
