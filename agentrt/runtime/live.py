"""The live display of `agentrt run`: per program run, calls done/total, what runs (and in which
phase), and what is stalled on what; refreshed while the runtime works."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, AsyncIterator

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from agentrt.runtime.progress import Progress, progress
from agentrt.runtime.terminal import PHASE_STYLE

if TYPE_CHECKING:
    from agentrt.runtime.runtime import Runtime

MAX_LINES = 8


def progress_view(items: list[Progress], engine_line: str = "") -> Group:
    lines = []
    for p in items:
        width = 24
        filled = int(width * p.done / p.total) if p.total else 0
        head = Text(f"{p.program} ", style="bold")
        head.append("█" * filled, style="green").append("░" * (width - filled), style="grey50")
        head.append(f" {p.done}/{p.total} calls  {p.status}")
        lines.append(head)
        for r in p.running[:MAX_LINES]:
            ch, style = PHASE_STYLE.get(r.phase, ("?", ""))
            lines.append(Text("  ").append(ch, style=style).append(f" {r.node}: {r.phase} {r.elapsed_s:.1f}s"))
        if len(p.running) > MAX_LINES:
            lines.append(Text(f"  … {len(p.running) - MAX_LINES} more running", style="dim"))
        for s in p.stalls[:MAX_LINES]:
            lines.append(Text(f"  ⏳ {s.describe()}", style="yellow"))
        if len(p.stalls) > MAX_LINES:
            lines.append(Text(f"  … {len(p.stalls) - MAX_LINES} more stalled", style="dim"))
    if engine_line:
        lines.append(Text(engine_line, style="dim"))
    return Group(*lines)


class LiveProgress:
    """async with LiveProgress(runtime, console): ... shows progress until the block ends.
    Without a terminal it prints nothing (the report after the run says it all)."""

    def __init__(self, runtime: Runtime, console: Console, refresh_s: float = 0.25) -> None:
        self.runtime, self.console, self.refresh_s = runtime, console, refresh_s
        self._task: asyncio.Task | None = None
        self._live: Live | None = None
        self._closed = False

    def render(self) -> Group:
        now = self.runtime.trace.now()
        items = [progress(rs, now) for rs in self.runtime.runs.values()]
        last = self.runtime.trace.last_engine_step
        line = "" if last is None else (f"engine step {last.step}: batch {last.batch_size}, drafted {last.drafted}, "
                                        f"accepted {last.accepted}, {1000 * last.duration_s:.0f} ms")
        return progress_view(items, line)

    async def __aenter__(self) -> LiveProgress:
        if self.console.is_terminal:
            self._live = Live(self.render(), console=self.console, transient=True, auto_refresh=False)
            self._live.__enter__()
            self._task = asyncio.get_running_loop().create_task(self._refresh_and_draw())
        return self

    @asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """The display off while the block runs (a person answering a question at the
        terminal), back on after it."""
        if self._live is None:
            yield
            return
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._live.stop()
        try:
            yield
        finally:
            if not self._closed:  # the run may have ended while the question was open
                self._live.start()
                self._task = asyncio.get_running_loop().create_task(self._refresh_and_draw())

    async def _refresh_and_draw(self) -> None:
        assert self._live is not None
        while True:
            self._live.update(self.render(), refresh=True)
            await asyncio.sleep(self.refresh_s)

    async def __aexit__(self, *exc: object) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._live is not None:
            self._live.__exit__(None, None, None)
