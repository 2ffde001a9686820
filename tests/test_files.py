"""Output files are replaced whole or left as they were (agentrt/files.py)."""
from __future__ import annotations

import os

import pytest

from agentrt.files import write_text_atomic


def test_writes_creates_the_folder_and_replaces_whole(tmp_path):
    path = tmp_path / "out" / "trace.jsonl"
    write_text_atomic(path, "one\n")
    write_text_atomic(path, "two\n")
    assert path.read_text() == "two\n"
    assert os.listdir(path.parent) == ["trace.jsonl"]  # no temporary left behind


def test_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "timeline.html"
    path.write_text("old")

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        write_text_atomic(path, "new")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["timeline.html"]
