"""The compliance report: ids found in test names and text, ranges, notes and answered questions."""

from __future__ import annotations

from pathlib import Path

from bcd_agent.tools.compliance import render, scan_answers, scan_deferred, scan_tests


def _tree(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "docs").mkdir()
    (repo / "tests" / "test_a.py").write_text(
        "def test_DLV_JRN_03_something():\n"
        '    """Covers DLV-REC-01..03 and DEV-CDI-04/05."""\n'
        "# Q-DLV-JRN-01 is a question, not DLV-JRN-01\n"
    )
    (repo / "docs" / "journal.md").write_text("Q-DLV-JRN-01: decided, because ...\n")
    (repo / "docs" / "open-questions.md").write_text(
        "# Deferred questions (not decided)\n\n- **Q-DLV-INST-01** deferred: no issue yet.\n"
        "- **Q-DLV-INST-02** deferred: no issue yet.\n"
    )
    (repo / "docs" / "instances.md").write_text("Q-DLV-INST-02 is still open, see open-questions.md\n")
    (repo / "docs" / "compliance-notes.toml").write_text(
        '[where]\n"DLV-JRN" = "agent/bcd_agent/journal/"\n[notes]\n"DLV-OOS" = "out of scope"\n'
    )
    return repo


def test_ids_in_names_docstrings_ranges_and_lists(tmp_path: Path) -> None:
    found = scan_tests(_tree(tmp_path) / "tests")
    assert set(found) == {
        "DLV-JRN-03",
        "DLV-REC-01",
        "DLV-REC-02",
        "DLV-REC-03",
        "DEV-CDI-04",
        "DEV-CDI-05",
    }


def test_questions_answered_in_docs(tmp_path: Path) -> None:
    """docs/open-questions.md answers nothing: the ids it names are deferred."""
    docs = _tree(tmp_path) / "docs"
    assert scan_answers(docs) == {
        "Q-DLV-JRN-01": {"docs/journal.md"},
        "Q-DLV-INST-02": {"docs/instances.md"},
    }
    assert scan_deferred(docs) == {"Q-DLV-INST-01", "Q-DLV-INST-02"}


def test_no_deferred_list(tmp_path: Path) -> None:
    docs = _tree(tmp_path) / "docs"
    (docs / "open-questions.md").unlink()
    assert scan_deferred(docs) == set()


def test_render_rows(tmp_path: Path) -> None:
    repo = _tree(tmp_path)
    spec = tmp_path / "spec"
    spec.mkdir()
    (spec / "delivery.md").write_text(
        "- **DLV-JRN-03** The journal fsyncs.\n"
        "- **DLV-JRN-04** Untested rule.\n"
        "- **DLV-OOS-01** Control plane thing. [control-plane]\n"
        "- **Q-DLV-JRN-01** A question?\n"
        "- **Q-DLV-JRN-02** Another question?\n"
        "- **Q-DLV-INST-01** Deferred?\n"
        "- **Q-DLV-INST-02** Deferred, named elsewhere too?\n"
    )
    (spec / "devices.md").write_text("")
    (spec / "host.md").write_text("")
    text = render(repo, spec)
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert rows["| DLV-JRN-03"].endswith(
        "| agent/bcd_agent/journal/ | `tests/test_a.py::test_DLV_JRN_03_something` | tested |"
    )
    assert rows["| DLV-JRN-04"].endswith("| not yet |")
    assert rows["| DLV-OOS-01"].endswith("| out of scope |")
    assert rows["| Q-DLV-JRN-01"].endswith("| answered in `docs/journal.md` |")
    assert rows["| Q-DLV-JRN-02"].endswith("| open |")
    assert rows["| Q-DLV-INST-01"].endswith("| deferred (docs/open-questions.md) |")
    assert rows["| Q-DLV-INST-02"].endswith(
        "| deferred (docs/open-questions.md); also named in `docs/instances.md` |"
    )
    assert "1 of 4 questions (Q- items) are answered" in text
    assert "deferred (listed, not decided, in docs/open-questions.md): 2; open: 1." in text


def test_test_names_with_several_areas_lists_and_ranges() -> None:
    from bcd_agent.tools.compliance import _name_ids

    assert _name_ids("HST_SYS_09_RMV_09_11") == ["HST-SYS-09", "HST-RMV-09", "HST-RMV-11"]
    assert _name_ids("HST_K8S_07_to_09_16") == ["HST-K8S-07", "HST-K8S-08", "HST-K8S-09", "HST-K8S-16"]
    assert _name_ids("DEV_CDI_04_DLV_DEV_12") == ["DEV-CDI-04", "DLV-DEV-12"]


def test_a_range_in_a_test_name_names_every_id_in_it(tmp_path: Path) -> None:
    """`_to_` is lower case: the name's id prefix must not end at it (it did, and `test_DLV_KIND_01_to_21_…`
    named DLV-KIND-01 only)."""
    tests = tmp_path / "repo" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_c.py").write_text(
        "def test_DLV_AAA_01_to_03_06_ranges_and_lists():\n    pass\n"
        "def test_DLV_BBB_02_tokens_are_words():\n    pass\n"
    )
    found = scan_tests(tests)
    assert sorted(found) == ["DLV-AAA-01", "DLV-AAA-02", "DLV-AAA-03", "DLV-AAA-06", "DLV-BBB-02"]


def test_a_word_starting_with_digits_ends_the_name_prefix(tmp_path: Path) -> None:
    """`_1g`, `_2m` are words (page sizes), not ids: `test_HST_HP_09_1g_…` names HST-HP-09 only (it named
    nothing), and a name whose first lower-case word starts with digits names no number of it."""
    tests = tmp_path / "repo" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_d.py").write_text(
        "def test_HST_HP_09_1g_pages_at_runtime_first():\n    pass\n"
        "def test_HST_HP_10_11_2m_then_1g():\n    pass\n"
        "def test_HST_HP_2m_and_1g_shortfalls():\n    pass\n"
        "def test_HST_HP_12_to_14_1g():\n    pass\n"
        "def test_HST_HP_20_21():\n    pass\n"
    )
    found = {k: sorted(v) for k, v in scan_tests(tests).items()}
    assert found == {
        "HST-HP-09": ["tests/test_d.py::test_HST_HP_09_1g_pages_at_runtime_first"],
        "HST-HP-10": ["tests/test_d.py::test_HST_HP_10_11_2m_then_1g"],
        "HST-HP-11": ["tests/test_d.py::test_HST_HP_10_11_2m_then_1g"],
        "HST-HP-12": ["tests/test_d.py::test_HST_HP_12_to_14_1g"],
        "HST-HP-13": ["tests/test_d.py::test_HST_HP_12_to_14_1g"],
        "HST-HP-14": ["tests/test_d.py::test_HST_HP_12_to_14_1g"],
        "HST-HP-20": ["tests/test_d.py::test_HST_HP_20_21"],
        "HST-HP-21": ["tests/test_d.py::test_HST_HP_20_21"],
    }


def test_an_area_with_digits_is_read_everywhere(tmp_path: Path) -> None:
    """`K8S` is an area: its requirements are rows of the report, named by test names and docstrings,
    and its questions are answered in the docs (the catalogue's HST-K8S and DEV-K8S ids had no row)."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "docs").mkdir()
    lines = ["def test_HST_K8S_14_to_15_join():", "    pass"]
    lines += ["def test_other():", '    """Covers DEV-K8S-03."""']
    (repo / "tests" / "test_k.py").write_text("\n".join(lines) + "\n")
    (repo / "docs" / "k8s.md").write_text("Q-HST-K8S-01: decided, because ...\n")
    spec = tmp_path / "spec"
    spec.mkdir()
    (spec / "delivery.md").write_text("")
    (spec / "devices.md").write_text("- **DEV-K8S-03** Device plugin.\n- **DEV-K8S-04** Untested.\n")
    (spec / "host.md").write_text(
        "- **HST-K8S-14** Packages.\n- **HST-K8S-15** The source.\n- **Q-HST-K8S-01** Which?\n"
    )
    text = render(repo, spec)
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert rows["| HST-K8S-14"].endswith("`tests/test_k.py::test_HST_K8S_14_to_15_join` | tested |")
    assert rows["| HST-K8S-15"].endswith("`tests/test_k.py::test_HST_K8S_14_to_15_join` | tested |")
    assert rows["| DEV-K8S-03"].endswith("`tests/test_k.py::test_other` | tested |")
    assert rows["| DEV-K8S-04"].endswith("| not yet |")
    assert rows["| Q-HST-K8S-01"].endswith("| answered in `docs/k8s.md` |")
    assert "3 of 4 requirements are named by at least one test." in text


def test_only_a_tests_name_docstring_or_decorator_names_an_id(tmp_path: Path) -> None:
    """A module docstring, a comment or a helper names nothing; a parametrize table a decorator refers
    to by name does; a class's test methods are listed with their class."""
    tests = tmp_path / "repo" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_b.py").write_text(
        '"""Covers DLV-AAA-01."""\n'
        "# DLV-AAA-02 in a comment\n"
        "ROWS = [('DLV-AAA-03', 1)]\n"
        "OTHER = ['DLV-AAA-04']\n"
        "def helper():\n"
        '    """DLV-AAA-05."""\n'
        "@pytest.mark.parametrize('row', ROWS)\n"
        "def test_rows(row):\n"
        "    assert OTHER\n"
        "class TestThing:\n"
        "    def test_DLV_AAA_06_method(self):\n"
        '        """And DLV-AAA-07."""\n'
    )
    found = scan_tests(tests)
    assert {k: sorted(v) for k, v in found.items()} == {
        "DLV-AAA-03": ["tests/test_b.py::test_rows"],
        "DLV-AAA-06": ["tests/test_b.py::TestThing::test_DLV_AAA_06_method"],
        "DLV-AAA-07": ["tests/test_b.py::TestThing::test_DLV_AAA_06_method"],
    }


def test_check_fails_on_a_listed_test_that_does_not_exist_and_on_a_stale_report(tmp_path: Path) -> None:
    from bcd_agent.tools.compliance import check

    repo = _tree(tmp_path)
    fresh = "| DLV-JRN-03 | x | y | `tests/test_a.py::test_DLV_JRN_03_something` | tested |\n"
    assert check(fresh, fresh, repo / "tests") == []
    gone = fresh.replace("test_DLV_JRN_03_something", "test_DLV_JRN_03_renamed")
    problems = check(gone, fresh, repo / "tests")
    assert problems == [
        "compliance.md lists tests/test_a.py::test_DLV_JRN_03_renamed, which is not a test function",
        "docs/compliance.md is out of date: run `make compliance` and commit it",
    ]
    assert check("", fresh, repo / "tests") == ["docs/compliance.md does not exist: run `make compliance`"]
