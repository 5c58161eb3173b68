"""Which code produced a published figure, and whether the code has changed since.

Every generated section of the docs (a benchmark table, a chaos matrix run) records the commit it ran on
and a fingerprint of the code it measures. A figure measured on code that has changed since must say so
where it is published: ``python -m torchpass_plugins.observe.provenance docs/benchmarks.md docs/reliability.md``
writes (or clears) a plain note after each such section, and the test suite fails while a section's note
is missing or names older code than the checked-out one. The fingerprint is computed from the code itself,
not from git history, so the check works in any copy of the repository.
"""

from __future__ import annotations

import ast
import hashlib
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
# Modules that only format and publish results: a change to them changes no measured figure.
REPORTING_ONLY = frozenset({"observe/provenance.py", "testing/chaos/cli.py"})
_FINGERPRINT = re.compile(r"code `([0-9a-f]{12})`")
_COMMIT = re.compile(r"[Cc]ommit:? `([0-9a-f]{7,40}|unknown)")
_DATE = re.compile(r"[Dd]ate:? (\d{4}-\d\d-\d\d)")
_STALE = re.compile(r"\n> \*\*Measured on older code\.\*\*[^\n]*<!-- stale code=([0-9a-f]{12}) -->")
_SECTION = re.compile(r"<!-- (\S+?):start -->(.*?)<!-- \1:end -->|<!-- chaos:begin (seed=\d+) -->(.*?)"
                      r"<!-- chaos:end \3 -->", re.S)


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=PACKAGE, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def commit() -> str:
    """The checked-out commit of this package, marked when the package had uncommitted changes ("unknown"
    outside a git checkout, e.g. an installed wheel)."""
    head = _git("rev-parse", "--short=10", "HEAD") or "unknown"
    return head + (" with uncommitted changes" if _git("status", "--porcelain", "--", ".") else "")


def _without_docstrings(source: str) -> str:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            body[:1] = [] if len(body) > 1 else [ast.Pass()]
    return ast.dump(tree)


def code_fingerprint(package: Path = PACKAGE) -> str:
    """A hash of the package's code as the interpreter sees it: comments, docstrings and formatting do not
    change it, any change to what runs does."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).as_posix()
        if name not in REPORTING_ONLY:
            digest.update(name.encode() + b"\0" + _without_docstrings(path.read_text()).encode() + b"\0")
    return digest.hexdigest()[:12]


def recorded() -> str:
    """The provenance a generated section prints: the commit and the fingerprint of the code it ran."""
    return f"commit `{commit()}`, code `{code_fingerprint()}`"


@dataclass(frozen=True)
class Section:
    """One generated section of a document: where it ends (its note goes right after) and where its note
    ends (the same place when it has none)."""

    name: str
    body: str
    end: int
    after: int
    note_code: str | None  # the fingerprint its "measured on older code" note names, if it has one

    @property
    def code(self) -> str | None:
        found = _FINGERPRINT.search(self.body)
        return found.group(1) if found else None

    def describe(self) -> str:
        found = _COMMIT.search(self.body)
        if found:
            return f"commit `{found.group(1)}`"
        date = _DATE.search(self.body)
        return (f"the code of {date.group(1)}" if date else "older code") + " (before results recorded their commit)"


def sections(text: str) -> list[Section]:
    found = []
    for match in _SECTION.finditer(text):
        name, body = (match.group(1), match.group(2)) if match.group(1) else (f"chaos {match.group(3)}", match.group(4))
        note = _STALE.match(text, match.end())
        found.append(Section(name, body, match.end(), note.end() if note else match.end(),
                             note.group(1) if note else None))
    return found


def undisclosed(text: str, current: str) -> list[str]:
    """Names of the sections of ``text`` measured on other code than ``current`` without a note saying so."""
    return [s.name for s in sections(text) if s.code != current and s.note_code != current]


def changed_modules(since: str) -> str:
    """The package's modules changed since commit ``since`` (from git, where the history is at hand)."""
    names = _git("diff", "--name-only", since, "--", ".") if re.fullmatch(r"[0-9a-f]{7,40}", since) else ""
    names = [n.split("torchpass_plugins/", 1)[-1] for n in names.splitlines()]
    names = [n for n in names if n.endswith(".py") and n not in REPORTING_ONLY]
    return ", ".join(f"`{n}`" for n in names) if names else "see the git history"


def disclose(text: str, current: str) -> str:
    """``text`` with a note after every section measured on other code than ``current`` (and none after the
    others): the plain statement the docs owe their readers until the figure is measured again."""
    for section in reversed(sections(text)):
        line = ""
        if section.code != current:
            found = _COMMIT.search(section.body)
            since = changed_modules(found.group(1)) if found else "see the git history"
            line = (f"\n> **Measured on older code.** These figures ran on {section.describe()}; the code has "
                    f"changed since (modules: {since}). Rerun the command above to measure the current code. "
                    f"<!-- stale code={current} -->")
        text = text[: section.end] + line + text[section.after :]
    return text


def main(argv: list[str]) -> int:
    current = code_fingerprint()
    for doc in map(Path, argv):
        text = doc.read_text()
        new = disclose(text, current)
        if new != text:
            doc.write_text(new)
        print(f"{doc}: {len(undisclosed(text, current))} section(s) on older code, now disclosed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
