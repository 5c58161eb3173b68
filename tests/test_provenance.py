"""Published figures say which code they measured, and say so plainly when the code has changed since."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchpass_plugins.observe.provenance import code_fingerprint, disclose, undisclosed

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _doc(code: str) -> str:
    return (
        "# Benchmarks\n\n<!-- regain:start -->\n- Date: 2026-12-01 10:00 UTC; commit `abcdef1234`, "
        f"code `{code}`\n\n| a | b |\n<!-- regain:end -->\n\ntext\n\n"
        "<!-- chaos:begin -->\n<!-- chaos:begin seed=1 -->\n"
        "- Code: commit `abcdef1234`, code `aaaaaaaaaaaa`; date: 2026-12-01\n<!-- chaos:end seed=1 -->\n"
        "<!-- chaos:end -->\n"
    )


def test_a_section_on_other_code_must_say_so_and_the_note_goes_when_measured_again():
    text = _doc("bbbbbbbbbbbb")
    assert undisclosed(text, "bbbbbbbbbbbb") == ["chaos seed=1"]
    assert undisclosed(text, "cccccccccccc") == ["regain", "chaos seed=1"]
    noted = disclose(text, "cccccccccccc")
    assert undisclosed(noted, "cccccccccccc") == []
    assert noted.count("Measured on older code") == 2 and disclose(noted, "cccccccccccc") == noted
    # A note naming older code than the checked-out one is itself stale.
    assert undisclosed(noted, "dddddddddddd") == ["regain", "chaos seed=1"]
    # Measured again on the current code: its note is removed, the other section's stays.
    remeasured = noted.replace("code `bbbbbbbbbbbb`", "code `dddddddddddd`")
    cleared = disclose(remeasured, "dddddddddddd")
    assert cleared.count("Measured on older code") == 1 and undisclosed(cleared, "dddddddddddd") == []


def test_the_fingerprint_follows_the_code_not_its_comments(tmp_path: Path):
    (tmp_path / "m.py").write_text('"""Doc."""\n\ndef f(x):\n    """Why."""\n    return x + 1\n')
    before = code_fingerprint(tmp_path)
    (tmp_path / "m.py").write_text('"""Other words."""\n\n\ndef f(x):  # a comment\n    return x + 1\n')
    assert code_fingerprint(tmp_path) == before
    (tmp_path / "m.py").write_text('"""Doc."""\n\ndef f(x):\n    return x + 2\n')
    assert code_fingerprint(tmp_path) != before


@pytest.mark.parametrize("doc", ["benchmarks.md", "reliability.md"])
def test_every_published_figure_ran_on_the_current_code_or_says_it_did_not(doc: str):
    missing = undisclosed((DOCS / doc).read_text(), code_fingerprint())
    assert not missing, (
        f"docs/{doc}: {missing} ran on older code and do not say so; rerun their commands, or run "
        f"`python -m torchpass_plugins.observe.provenance docs/{doc}` to disclose it"
    )
