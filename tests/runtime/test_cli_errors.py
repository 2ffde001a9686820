"""User errors on the command line end in one line (`error: ...`, exit 2) naming what is wrong,
before any work starts; a bug in agentrt says that it is one."""
from __future__ import annotations

import json

import pytest

from agentrt.cli import main
from agentrt.engine.loading.registry import weight_files
from agentrt.errors import ModelLoadError
from agentrt.tools.mqtt_protocol import MqttConfig


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_a_program_file_with_a_syntax_error(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("from agentrt.dag import Program\n\nprogram = Program('x'\n")
    assert f"{bad}:3: syntax error" in one_line_error(capsys, ["run", str(bad)])


def test_a_program_file_that_raises_names_its_line(tmp_path, capsys):
    bad = tmp_path / "raises.py"
    bad.write_text("x = 1\nraise KeyError('oops')\n")
    assert f"{bad}:2: importing it raised KeyError" in one_line_error(capsys, ["run", str(bad)])


def test_an_unwritable_trace_path_is_refused_before_the_run(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = one_line_error(capsys, ["run", "examples/trip_planner.py", "--trace", str(blocker / "t.jsonl")])
    assert "--trace" in err and "cannot" in err


@pytest.mark.parametrize("content, fragment", [
    (b"\xff\xfe\x00garbage" * 20, "not UTF-8 text"),
    (json.dumps({"type": "trace", "version": 1}).encode() + b"\n" + json.dumps({"type": "span"}).encode() + b"\n",
     "lack what an agentrt trace holds"),
])
def test_inspect_on_garbage_or_broken_records(tmp_path, capsys, content, fragment):
    from agentrt.runtime.trace import TRACE_VERSION

    path = tmp_path / "t.jsonl"
    path.write_bytes(content.replace(b'"version": 1', f'"version": {TRACE_VERSION}'.encode()))
    assert fragment in one_line_error(capsys, ["inspect", str(path)])


def test_a_safetensors_index_may_only_name_files_beside_it(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../secret.safetensors"}}))
    with pytest.raises(ModelLoadError, match="not a file name in the model folder"):
        weight_files(tmp_path)


def test_the_mqtt_password_is_never_printed():
    assert "hunter2" not in repr(MqttConfig(username="u", password="hunter2"))


def test_an_unknown_device_is_a_user_error(capsys):
    assert "device 'bogus' is not a device torch knows" in one_line_error(
        capsys, ["generate", "hi", "--device", "bogus", "--max-tokens", "2"])


@pytest.mark.parametrize("argv,fragment", [
    (["--spec", "suffix", "--k", "-3"], "k (the draft length) must be an integer >= 0"),
    (["--spec", "bogus"], "unknown drafter 'bogus'; choose none, suffix, template"),
])
def test_bad_speculation_settings_are_refused_before_any_step(capsys, argv, fragment):
    assert fragment in one_line_error(capsys, ["generate", "hi", "--max-tokens", "2", *argv])
