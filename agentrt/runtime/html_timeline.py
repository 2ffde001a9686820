"""`agentrt inspect --html`: one self-contained HTML page drawn by the same renderer as the web
console (agentrt/runtime/webview: plain ES modules and SVG, no library, nothing fetched).

The page inlines webview/view.css, embeds the trace as
`<script type="application/json" id="agentrt-trace">{"summary": ..., "records": [...]}</script>`,
and inlines the renderer modules, concatenated in dependency order into one
`<script type="module">`: their one-line `import` statements are dropped and the `export`
keyword at line starts removed (the modules are written for that: imports one per line at the
top, top-level names unique across the files). standalone.js, last, draws every run."""
from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path
from typing import Any

WEBVIEW = Path(__file__).parent / "webview"
MODULES = ("phases.js", "model.js", "live.js", "timeline.js", "dag.js", "details.js", "standalone.js")
STYLESHEET = "view.css"

_IMPORT = re.compile(r"^import\s")
_EXPORT = re.compile(r"^export\s+(?=(?:async\s+)?function\b|const\b|let\b|class\b)")


def webview_text(name: str) -> str:
    return (WEBVIEW / name).read_text(encoding="utf-8")


def inline_modules(names: tuple[str, ...] = MODULES) -> str:
    """The renderer modules as one script: import lines dropped, `export ` at line starts removed."""
    parts = []
    for name in names:
        lines = []
        for line in webview_text(name).split("\n"):
            if _IMPORT.match(line):
                continue
            if line.startswith("export "):
                stripped = _EXPORT.sub("", line, count=1)
                if stripped == line:  # `export default`, `export { … }`: the modules must not use them
                    raise ValueError(f"webview/{name}: cannot inline {line.strip()!r}")
                line = stripped
            lines.append(line)
        parts.append(f"// ---- {name} ----\n" + "\n".join(lines))
    return _script_safe("\n".join(parts))


def _script_safe(text: str) -> str:
    """Text that cannot end or re-open the <script> element it sits in: `</` becomes `<\\/`
    (the same string in JSON and in a JS string), `<!--` becomes `\\u003c!--` (it would put the
    HTML parser in its escaped script state, where a later `</script>` is not the end)."""
    return text.replace("</", "<\\/").replace("<!--", "\\u003c!--")


def _finite(value: Any) -> Any:
    """NaN and infinities as null: JSON.parse rejects them (Python's json writes them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def embed_json(data: Any) -> str:
    """data as JSON safe inside <script type="application/json">."""
    try:
        text = json.dumps(data, ensure_ascii=False, default=repr, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(data), ensure_ascii=False, default=repr, allow_nan=False)
    return _script_safe(text)


def render_html(summary: dict[str, Any], records: list[dict[str, Any]]) -> str:
    title = html.escape(str(summary.get("trace", {}).get("name") or "agentrt trace"), quote=True)
    css = webview_text(STYLESHEET).replace("</", "<\\/")  # a stylesheet cannot close its <style> either
    data = embed_json({"summary": summary, "records": records})
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} · agentrt</title>
<style>
{css}
</style></head>
<body class="av-page">
<div id="agentrt-root"></div>
<noscript><p>This page draws the trace with JavaScript; `agentrt inspect TRACE` shows it in a terminal.</p></noscript>
<script type="application/json" id="agentrt-trace">{data}</script>
<script type="module">
{inline_modules()}
</script>
</body></html>
"""
