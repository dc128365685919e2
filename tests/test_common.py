"""nanochat/common.py: what every entry point shares."""

import sys

from nanochat.common import progress_bar


def test_progress_bar_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert progress_bar(range(3)).disable
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert not progress_bar(range(3)).disable
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")):  # as torchrun sets them
        monkeypatch.setenv(name, value)
    assert progress_bar(range(3)).disable
