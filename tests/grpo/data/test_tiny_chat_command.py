"""`python -m hf_mcore_bridge.grpo.data.tiny_chat`'s command line: help writes nothing, a used directory is refused
in one line with exit status 2 and left as it was."""

from __future__ import annotations

import os

import pytest

from hf_mcore_bridge.grpo.data.tiny_chat import main


def test_help_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "OUT_DIR" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind", ["file", "non-empty directory"])
def test_a_used_destination_is_refused_in_one_line(tmp_path, capsys, kind):
    target = tmp_path / "out"
    if kind == "file":
        target.write_text("mine")
    else:
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as done:
        main([str(target)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1 and "not an empty directory" in err
    assert (target.read_text() if kind == "file" else (target / "notes.txt").read_text()) == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
