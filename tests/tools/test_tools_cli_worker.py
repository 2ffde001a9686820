"""`agentrt worker`: loading a module's tools, the command line, broker URLs."""
from __future__ import annotations

import subprocess
import sys

import pytest
from tool_test_helpers import REPO, WORKER_TOOLS

from agentrt.tools import ToolDefinitionError
from agentrt.tools.errors import MqttConfigError
from agentrt.tools.loader import load_tools
from agentrt.tools.mqtt_protocol import MqttConfig


def test_load_tools_from_file_and_module(tmp_path):
    names = {t.name for t in load_tools(WORKER_TOOLS)}
    assert {"echo", "nap", "slow_idempotent", "slow_once", "record", "big", "boom"} <= names
    demo = load_tools(str(REPO / "examples" / "tools_demo" / "tools.py"))
    assert sorted(t.name for t in demo) == ["get_weather", "hypotenuse"]
    listed = tmp_path / "listed.py"
    listed.write_text(
        "from agentrt.tools import tool\n"
        "def shout(text: str) -> str:\n    'Upper-case.'\n    return text.upper()\n"
        "@tool\ndef hidden() -> int:\n    'Not listed.'\n    return 1\n"
        "TOOLS = [shout]\n"
    )
    assert [t.name for t in load_tools(str(listed))] == ["shout"]  # TOOLS wins; plain functions are wrapped
    assert [t.name for t in load_tools("agentrt.bench.tools")] == ["echo", "sleep_50ms"]


def test_load_tools_errors(tmp_path):
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n")
    with pytest.raises(ToolDefinitionError, match="no tools found in"):
        load_tools(str(empty))
    with pytest.raises(ToolDefinitionError, match="does not exist"):
        load_tools(str(tmp_path / "missing.py"))
    with pytest.raises(ToolDefinitionError, match="cannot import tool module 'no_such_pkg.tools'"):
        load_tools("no_such_pkg.tools")


def test_cli_reports_errors_without_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "agentrt.cli", "worker", str(tmp_path / "nope.py")],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2 and "error: tool module" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "agentrt.cli", "worker", WORKER_TOOLS, "--tools", "echo,nope"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2 and "no tool(s) ['nope']" in out.stderr


def test_broker_urls():
    c = MqttConfig.from_url("mqtt://broker.local:1884", group="gpu")
    assert (c.host, c.port, c.tls, c.group) == ("broker.local", 1884, False, "gpu")
    s = MqttConfig.from_url("mqtts://agent:p%40ss@10.0.0.5")
    assert (s.port, s.tls, s.username, s.password) == (8883, True, "agent", "p@ss")
    assert s.url == "mqtts://agent@10.0.0.5:8883"  # never the password
    assert c.shared_call_filter("echo") == "$share/gpu/agentrt/gpu/call/echo"
    with pytest.raises(MqttConfigError, match="expected mqtt://HOST:PORT"):
        MqttConfig.from_url("http://x:1")
    with pytest.raises(MqttConfigError, match="group 'a/b'"):
        MqttConfig(group="a/b")
