"""Tokenizer: a `tokenizers.Tokenizer` (tokenizer.json) plus the chat template and stop tokens.

Chat templates are rendered as transformers renders them: a sandboxed jinja2 environment with
trim_blocks/lstrip_blocks, loop controls, a `tojson` that does not escape HTML, raise_exception
and strftime_now. Templates come from model repositories and are untrusted code.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from agentrt.errors import ModelLoadError, RequestError

_REPLACEMENT = "\ufffd"  # what a byte-level decoder emits for an incomplete UTF-8 sequence


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None


def _token_content(value: Any) -> str | None:
    """tokenizer_config special tokens are strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _find_chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str | None:
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template:
        return template
    if (path / "chat_template.jinja").is_file():  # newer HF layout
        return (path / "chat_template.jinja").read_text()
    return _read_json(path / "chat_template.json").get("chat_template")


def _plain(value: Any) -> Any:
    """Template inputs rebuilt from plain JSON types, so the sandbox never sees foreign objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, str):  # subclasses (enums...) carry methods the sandbox does not know
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    raise RequestError(f"chat template input of type {type(value).__name__} is not plain JSON data: {value!r}")


def compile_chat_template(source: str) -> Any:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; we render it as-is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env, env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ModelLoadError(f"chat template does not compile: {e}") from None


class Tokenizer:
    """A model's tokenizer. `hf` is the raw tokenizers.Tokenizer (xgrammar's TokenizerInfo takes it)."""

    def __init__(self, hf: Any, tokenizer_config: dict[str, Any], eos_token_ids: tuple[int, ...],
                 bos_token_id: int | None, chat_template: str | None, source: str = "tokenizer"):
        self.hf = hf
        self.tokenizer_config = tokenizer_config
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.source = source

    @classmethod
    def from_dir(cls, path: Path | str) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"{path}: missing tokenizer.json")
        try:
            hf = HFTokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad files
            raise ModelLoadError(f"{file}: cannot load tokenizer ({e})") from None
        tokenizer_config = _read_json(path / "tokenizer_config.json")
        model_config = _read_json(path / "config.json")
        generation_config = _read_json(path / "generation_config.json")
        template = _find_chat_template(path, tokenizer_config)

        def token_id(key: str) -> int | None:
            content = _token_content(tokenizer_config.get(key))
            return hf.token_to_id(content) if content is not None else None

        # Stop tokens: every source that names one. ChatML templates end a turn with <|im_end|>
        # even where config.json names only <|endoftext|> as eos.
        eos = _ids(generation_config.get("eos_token_id")) + _ids(model_config.get("eos_token_id"))
        eos += [i for i in (token_id("eos_token"),) if i is not None]
        if template and "<|im_end|>" in template and hf.token_to_id("<|im_end|>") is not None:
            eos.append(hf.token_to_id("<|im_end|>"))
        bos = model_config.get("bos_token_id", token_id("bos_token"))
        return cls(hf, tokenizer_config, tuple(dict.fromkeys(eos)), bos, template, source=str(path))

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def special_token(self, key: str) -> str | None:
        """"bos_token", "eos_token", "unk_token" or "pad_token" as tokenizer_config.json names it."""
        return _token_content(self.tokenizer_config.get(key))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _compiled_template(self) -> tuple[Any, Any]:
        if not self.chat_template:
            raise ModelLoadError(f"{self.source}: no chat_template (tokenizer_config.json, chat_template.jinja)")
        return compile_chat_template(self.chat_template)

    @cached_property
    def has_tools_template(self) -> bool:
        """Whether the chat template reads a `tools` variable (renders tool definitions itself)."""
        if not self.chat_template:
            return False
        from jinja2 import meta

        env, _ = self._compiled_template
        return "tools" in meta.find_undeclared_variables(env.parse(self.chat_template))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **template_kwargs: Any) -> str:
        """The prompt text for `messages` (role/content dicts); tokenize it with add_special_tokens=False."""
        import jinja2

        _, template = self._compiled_template
        context = {key: self.special_token(key) for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
        context.update(_plain(template_kwargs))
        try:
            return template.render(messages=_plain(messages), tools=_plain(tools),
                                   add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as e:
            raise RequestError(f"chat template rejected the messages: {e}") from None


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, never splitting a multi-byte character.

    Each push decodes a short window [prefix_offset:] and emits what it adds beyond the already
    emitted window [prefix_offset:read_offset]. Decoding a window that starts one token back keeps
    decoders that treat the first token specially (sentencepiece's leading space) consistent with
    decoding everything. A window ending in an incomplete UTF-8 sequence emits nothing yet.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | tuple[int, ...] = (),
                 skip_special_tokens: bool = True, context_tokens: int = 5):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-context_tokens:]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)  # the prompt context is never emitted
        self._start = len(self.ids)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    @property
    def token_ids(self) -> list[int]:
        """The pushed ids (without prompt context)."""
        return self.ids[self._start:]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; returns the newly completed text (possibly '')."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        piece = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._pieces.append(piece)
        return piece

    def finish(self) -> str:
        """Flush text held back at the end (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        piece = new_text[len(prefix_text):] if new_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        if piece:
            self._pieces.append(piece)
        return piece
