"""The quick tier's selection (tests/quick_tier.py): entries select exactly what they name."""

from __future__ import annotations

from quick_tier import QUICK, select


def test_entries_select_a_file_a_test_or_one_case_and_report_those_that_select_nothing(monkeypatch):
    ids = ["test_a.py::test_x[2dev]", "test_a.py::test_x[4dev]", "test_a.py::test_xy", "test_b.py::test_z"]
    monkeypatch.setattr("quick_tier.QUICK", (("test_a.py::test_x[2dev]", ""), ("test_b.py", ""), ("test_c.py", "")))
    assert select(ids) == ([True, False, False, True], ["test_c.py"])
    monkeypatch.setattr("quick_tier.QUICK", (("test_a.py::test_x", ""),))
    assert select(ids) == ([True, True, False, False], [])


def test_every_entry_says_why():
    assert all(entry.startswith("test_") and why for entry, why in QUICK)
