"""Generate docs/compliance.md: for every requirement id, where it is implemented and tested.

Sources:
- the requirement catalogue (../shared/spec/*.md beside the checkout): lines `- **ID** text [tags]`;
- the tests: an id named by a test function: in its name (`DLV_JRN_03`), its docstring or its decorators
  (`DLV-JRN-03`), never a module docstring or a comment; rows list the test functions;
- docs/compliance-notes.toml: `[where]` maps an id prefix (area or single id) to where it is
  implemented, `[notes]` maps an id prefix to a status note (why not yet, a departure, ...).
  The longest matching prefix wins.
- the docs: a question (`Q-...`) named in any docs/*.md is answered there, except in
  docs/open-questions.md, which lists questions deliberately left undecided: those are reported
  "deferred" (even when another doc names them too; the row then lists those docs, so a stale entry
  shows).

Run: `python -m bcd_agent.tools.compliance` (also `make compliance`).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import tomllib
from collections import defaultdict
from pathlib import Path

# An area is upper case and may hold digits after its first letter (`HST-K8S-14`, `DEV-K8S-03`).
AREA = r"[A-Z][A-Z0-9]*"
ID_LINE = re.compile(rf"^- \*\*((?:Q-)?(?:DLV|DEV|HST)-{AREA}-\d+)\*\*\s*(.*)$")
# An id in text (`DLV-JRN-03`) or in a test name (`test_DLV_JRN_03_...`: `_` is a word character, so no
# \b). A run of numbers names each (`DLV_RES_01_02_03`, `DLV-JRN-15/16/17`), a range every id in it
# (`DLV-REC-01..11`, `DLV_KIND_01_to_21`). A question's id (`Q-DLV-...`) does not name its requirement.
ID_IN_TEXT = re.compile(
    rf"(?<![A-Za-z0-9])(?<!Q[-_])(DLV|DEV|HST)[-_]({AREA})[-_](\d+)((?:\.\.|_to_)\d+|(?:[_/]\d+)*)(?![0-9])"
)
# A test function's name may name several areas and mix lists and ranges after the first id
# (`test_HST_SYS_09_RMV_09_...`, `test_HST_K8S_07_to_13_16_...`): its upper-case prefix is read token by
# token, an area token switching the area for the numbers after it. The prefix runs on over a lower-case
# `_to_` followed by a number (a range), and ends at any other lower-case word, including one that starts
# with digits (`test_HST_HP_09_1g_...` names HST-HP-09: `1g` is a page size, not an id).
TEST_NAME = re.compile(
    r"\bdef test_((?:DLV|DEV|HST)_[A-Z0-9_]+?(?:_to_\d+[A-Z0-9_]*?)*)(?=_\d*[a-z]|\(|$)", re.M
)
CATALOGUES = ("delivery.md", "devices.md", "host.md")


def read_catalogue(spec_dir: Path) -> list[tuple[str, str, str]]:
    """(id, text, tags) for every requirement and question, in catalogue order."""
    rows = []
    for name in CATALOGUES:
        for line in (spec_dir / name).read_text().splitlines():
            m = ID_LINE.match(line)
            if m:
                text = m.group(2)
                tags = " ".join(re.findall(r"\[(?:node|helper|gateway|control-plane)\]", text))
                rows.append((m.group(1), text, tags))
    return rows


def scan_tests(tests_dir: Path) -> dict[str, set[str]]:
    """id -> the test functions (`tests/x.py::test_f`, `tests/x.py::Class::test_f`) naming it.

    Only a test names an id: its function name, its own docstring, or one of its decorators (with the
    module-level tables a decorator refers to by name, such as a parametrize table). A module docstring,
    a comment or a helper elsewhere in the file names nothing: a claim must sit on the test that makes it.
    """
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted(tests_dir.rglob("*.py")):
        if path.parent.name == "tools" and path.parent.parent == tests_dir:
            continue  # the report's own tests name ids as sample data
        if not path.name.startswith("test"):
            continue
        rel = str(path.relative_to(tests_dir.parent))
        for qualname, ids in _test_ids(path.read_text(errors="replace")):
            for ident in ids:
                found[ident].add(f"{rel}::{qualname}")
    return found


def test_functions(tests_dir: Path) -> set[str]:
    """Every test function in the tree, as `tests/x.py::name` (for --check)."""
    names: set[str] = set()
    for path in sorted(tests_dir.rglob("test*.py")):
        rel = str(path.relative_to(tests_dir.parent))
        names |= {f"{rel}::{q}" for q, _ in _test_ids(path.read_text(errors="replace"))}
    return names


def _text_ids(text: str) -> list[str]:
    return [ident for m in ID_IN_TEXT.finditer(text) for ident in _ids(*m.groups())]


def _test_ids(source: str) -> list[tuple[str, list[str]]]:
    """(qualified name, ids) for each test function of one module."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    tables: dict[str, str] = {}
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        for target in targets:
            if isinstance(target, ast.Name):
                tables[target.id] = ast.get_source_segment(source, node) or ""
    out: list[tuple[str, list[str]]] = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                visit(node.body, f"{prefix}{node.name}::")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                ids: list[str] = []
                m = TEST_NAME.match(f"def {node.name}")
                if m:
                    ids += _name_ids(m.group(1))
                ids += _text_ids(ast.get_docstring(node) or "")
                for dec in node.decorator_list:
                    ids += _text_ids(ast.get_source_segment(source, dec) or "")
                    for sub in ast.walk(dec):
                        if isinstance(sub, ast.Name) and sub.id in tables:
                            ids += _text_ids(tables[sub.id])
                out.append((prefix + node.name, ids))

    visit(tree.body, "")
    return out


def _name_ids(prefix: str) -> list[str]:
    """The ids a test name's upper-case prefix names (`HST_SYS_09_RMV_09_11` -> SYS-09, RMV-09, RMV-11)."""
    tokens = prefix.split("_")
    catalogue, area, out = tokens[0], "", []
    last: str | None = None
    i = 1
    while i < len(tokens):
        tok = tokens[i]
        following = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok in ("DLV", "DEV", "HST") and following[:1].isalpha():  # `DLV_DEV_12`: DEV is an area
            catalogue, area, last = tok, "", None
        elif tok.isdigit() and area:
            out.append(f"{catalogue}-{area}-{tok}")
            last = tok
        elif tok == "to" and last is not None and i + 1 < len(tokens) and tokens[i + 1].isdigit():
            end = tokens[i + 1]
            out += [f"{catalogue}-{area}-{n:0{len(last)}d}" for n in range(int(last) + 1, int(end) + 1)]
            last, i = end, i + 1
        elif tok.isalnum() and tok[:1].isalpha() and tok.isupper():
            area, last = tok, None
        else:
            break
        i += 1
    return out


def _ids(area: str, part: str, first: str, tail: str) -> list[str]:
    """The ids one ID_IN_TEXT match names."""
    width = len(first)
    if tail.startswith(("..", "_to_")):
        last = int(tail.removeprefix("..").removeprefix("_to_"))
        numbers = list(range(int(first), max(int(first), last) + 1))
    else:
        numbers = [int(first)] + [int(n) for n in re.split(r"[_/]", tail)[1:]]
    return [f"{area}-{part}-{n:0{width}d}" for n in numbers]


Q_IN_DOCS = re.compile(rf"\bQ-(?:DLV|DEV|HST)-{AREA}-\d+\b")
# The questions deliberately left undecided (docs/open-questions.md, "Deferred questions (not decided)").
DEFERRED_DOC = "open-questions.md"


def scan_answers(docs_dir: Path) -> dict[str, set[str]]:
    """Q id -> the docs (relative) that record a decision on it (not the report, not the deferred list)."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted(docs_dir.rglob("*.md")):
        if path.name == "compliance.md" or path.relative_to(docs_dir).as_posix() == DEFERRED_DOC:
            continue
        for m in Q_IN_DOCS.finditer(path.read_text(errors="replace")):
            found[m.group(0)].add(str(path.relative_to(docs_dir.parent)))
    return found


def scan_deferred(docs_dir: Path) -> set[str]:
    """Q ids named in docs/open-questions.md: deferred, not decided."""
    path = docs_dir / DEFERRED_DOC
    if not path.exists():
        return set()
    return {m.group(0) for m in Q_IN_DOCS.finditer(path.read_text(errors="replace"))}


def _lookup(table: dict[str, str], ident: str) -> str:
    best = ""
    for prefix in table:
        if ident.startswith(prefix) and len(prefix) > len(best):
            best = prefix
    return table.get(best, "")


def render(repo: Path, spec_dir: Path) -> str:
    notes_file = repo / "docs" / "compliance-notes.toml"
    notes = tomllib.loads(notes_file.read_text()) if notes_file.exists() else {}
    where: dict[str, str] = notes.get("where", {})
    status: dict[str, str] = notes.get("notes", {})
    tested = scan_tests(repo / "tests")
    answered = scan_answers(repo / "docs")
    deferred = scan_deferred(repo / "docs")
    rows = read_catalogue(spec_dir)
    reqs = [r for r in rows if not r[0].startswith("Q-")]
    questions = [r for r in rows if r[0].startswith("Q-")]
    n_tested = sum(1 for r in reqs if tested.get(r[0]))
    n_deferred = sum(1 for r in questions if r[0] in deferred)
    n_answered = sum(1 for r in questions if r[0] not in deferred and answered.get(r[0]))
    out = [
        "# Compliance with the requirement catalogue",
        "",
        "Generated by `python -m bcd_agent.tools.compliance` from ../shared/spec/, the tests naming each id,",
        "and docs/compliance-notes.toml (where each area is implemented, and why an item is not done yet).",
        "Do not edit by hand: edit the notes file or the tests and regenerate.",
        "",
        f"{n_tested} of {len(reqs)} requirements are named by at least one test.",
        f"{n_answered} of {len(questions)} questions (Q- items) are answered in the docs named in their row;",
        f"deferred (listed, not decided, in docs/{DEFERRED_DOC}): {n_deferred};"
        f" open: {len(questions) - n_answered - n_deferred}.",
        "",
        "| Id | Requirement | Implemented in | Tested by | Status |",
        "| --- | --- | --- | --- | --- |",
    ]
    for ident, text, _tags in rows:
        summary = text if len(text) <= 140 else text[:137] + "..."
        summary = summary.replace("|", "\\|")
        tests = "<br>".join(f"`{t}`" for t in sorted(tested.get(ident, ())))
        note = _lookup(status, ident)
        if ident.startswith("Q-"):
            docs = ", ".join(f"`{d}`" for d in sorted(answered.get(ident, ())))
            if ident in deferred:
                note = f"deferred (docs/{DEFERRED_DOC})" + (f"; also named in {docs}" if docs else "")
            else:
                note = f"answered in {docs}" if docs else (note or "open")
        elif not note:
            note = "tested" if tests else "not yet"
        out.append(f"| {ident} | {summary} | {_lookup(where, ident)} | {tests} | {note} |")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    repo = Path(__file__).resolve().parents[3]
    parser.add_argument("--spec", type=Path, default=repo.parent / "shared" / "spec")
    parser.add_argument("--out", type=Path, default=repo / "docs" / "compliance.md")
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when the report names a test that does not exist or is out of date",
    )
    args = parser.parse_args()
    if not (args.spec / "delivery.md").exists():
        # A user's clone has no ../shared beside it: nothing to check against (CI always has it).
        print(f"compliance: no requirement catalogue at {args.spec}")
        return 1 if os.environ.get("CI") == "true" or not args.check else 0
    text = render(repo, args.spec)
    if not args.check:
        args.out.write_text(text)
        print(f"wrote {args.out}")
        return 0
    problems = check(args.out.read_text() if args.out.exists() else "", text, repo / "tests")
    for problem in problems:
        print(problem)
    return 1 if problems else 0


LISTED_TEST = re.compile(r"`(tests/[^`:]+\.py::[A-Za-z0-9_:]+)`")


def check(report: str, fresh: str, tests_dir: Path) -> list[str]:
    """What is wrong with a kept report: listed tests that do not exist, and staleness."""
    existing = test_functions(tests_dir)
    problems = [
        f"compliance.md lists {name}, which is not a test function"
        for name in sorted(set(LISTED_TEST.findall(report)))
        if name not in existing
    ]
    if not report:
        problems.append("docs/compliance.md does not exist: run `make compliance`")
    elif report != fresh:
        problems.append("docs/compliance.md is out of date: run `make compliance` and commit it")
    return problems


if __name__ == "__main__":
    raise SystemExit(main())
