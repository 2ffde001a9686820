"""How to reach an MCP server: a command run over stdio, or a streamable-HTTP URL with headers.

`agentrt run/serve --mcp NAME=COMMAND_OR_URL` configures servers by name before the program files
are imported; a program's `mcp_tools(NAME)` then takes that server (and a flag overrides the
command or URL a program module gives for the same name, so one program file runs against a test
server or a deployed one).
"""
from __future__ import annotations

import logging
import re
import shlex
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from agentrt.tools.errors import ToolDefinitionError

log = logging.getLogger("agentrt.tools.mcp")

_SERVER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


@dataclass(frozen=True)
class McpServerSpec:
    """One MCP server. `name` prefixes its tools in the registry (`NAME.tool`). Exactly one of
    `command` (argv, started as a child process speaking MCP on stdin/stdout) and `url` (streamable
    HTTP; `headers` go with every request, e.g. Authorization) is set. `env` adds variables to the
    child's environment; `cwd` is its working directory."""

    name: str
    command: tuple[str, ...] = ()
    url: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _SERVER_NAME.match(self.name):
            raise ToolDefinitionError(f"MCP server name {self.name!r} must be 1-32 letters, digits, '_' or '-' "
                                      "(it prefixes the server's tool names)")
        if bool(self.command) == bool(self.url):
            raise ToolDefinitionError(f"MCP server '{self.name}': give exactly one of command=[...] (stdio) "
                                      "or url=... (streamable HTTP)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ToolDefinitionError(f"MCP server '{self.name}': url must start with http:// or https://, "
                                      f"got {self.url!r}")
        if self.headers and not self.url:
            raise ToolDefinitionError(f"MCP server '{self.name}': headers= only apply to a url= server")

    @property
    def where(self) -> str:
        """The server as an error message names it (never its headers: they may hold a secret)."""
        return self.url if self.url else shlex.join(self.command)

    @classmethod
    def of(cls, name: str, *, command: Sequence[str] | str | None = None, url: str | None = None,
           headers: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
           cwd: str | None = None) -> McpServerSpec:
        """From the keyword form (a command as a list, or one string split as a shell would)."""
        argv = tuple(shlex.split(command) if isinstance(command, str) else command or ())
        return cls(name, argv, url, tuple((headers or {}).items()), tuple((env or {}).items()),
                   None if cwd is None else str(cwd))


def parse_flag(text: str) -> McpServerSpec:
    """`NAME=COMMAND_OR_URL` (the --mcp flag): a URL when it starts with http:// or https://,
    else a command line split as a shell would."""
    name, sep, target = text.partition("=")
    name, target = name.strip(), target.strip()
    if not sep or not name or not target:
        raise ToolDefinitionError(f"--mcp {text!r}: write NAME=COMMAND or NAME=URL, e.g. "
                                  "--mcp files='python files_server.py' or --mcp db=http://127.0.0.1:9000/mcp")
    if target.startswith(("http://", "https://")):
        return McpServerSpec.of(name, url=target)
    try:
        return McpServerSpec.of(name, command=target)
    except ValueError as e:  # shlex: an unclosed quote
        raise ToolDefinitionError(f"--mcp {name}: cannot split the command {target!r}: {e}") from None


_CONFIGURED: dict[str, McpServerSpec] = {}


def configure_servers(specs: Sequence[McpServerSpec]) -> None:
    """Servers given on the command line, by name, for the program files imported after this."""
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ToolDefinitionError(f"--mcp {spec.name}: given twice")
        seen.add(spec.name)
    _CONFIGURED.clear()
    _CONFIGURED.update({s.name: s for s in specs})


def configured(name: str) -> McpServerSpec | None:
    return _CONFIGURED.get(name)


def resolve_spec(declared: McpServerSpec | None, name: str) -> McpServerSpec:
    """The server a program's `mcp_tools(name, ...)` gets: the --mcp flag's if one names it, else
    the program's own declaration."""
    flag = _CONFIGURED.get(name)
    if flag is not None:
        if declared is not None and declared != flag:
            log.info("MCP server '%s': --mcp %s replaces the program's %s", name, flag.where, declared.where)
        return flag
    if declared is None:
        raise ToolDefinitionError(f"mcp_tools('{name}'): no command= or url= given, and no --mcp {name}=... "
                                  "on the command line")
    return declared


def add_mcp_argument(p: Any) -> None:
    """--mcp NAME=COMMAND_OR_URL on an argparse parser (agentrt run, resume, serve)."""
    p.add_argument("--mcp", action="append", default=[], metavar="NAME=COMMAND_OR_URL",
                   help="an MCP server whose tools are NAME.tool (repeatable): a command started over stdio, or a "
                        "streamable-HTTP URL; a program's mcp_tools(NAME) takes it, over what the program gives")


def configure_from_flags(values: Sequence[str]) -> list[McpServerSpec]:
    """The --mcp values parsed and configured for the program files imported next."""
    specs = [parse_flag(v) for v in values]
    configure_servers(specs)
    return specs
