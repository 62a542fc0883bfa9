"""nsbox/errors.py: the notes and warnings said once per process."""

from __future__ import annotations

import pytest

from nsbox import errors


def test_each_note_and_warning_is_said_once(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(errors, "_said", set())
    for _ in range(2):
        errors.note_once("the host's /proc is masked")
        errors.warn_once("memory is not enforced")
        errors.warn_once("the host's /proc is masked")  # a warning is not the note of the same text
    assert capsys.readouterr().err.splitlines() == [
        "nsbox: note: the host's /proc is masked",
        "nsbox: warning: memory is not enforced",
        "nsbox: warning: the host's /proc is masked",
    ]
