"""Evaluation arithmetic: pass@k against hand computations, the table row, the saved
files."""

from __future__ import annotations

import csv
import json
from fractions import Fraction

import pytest

from launcher.evaluate import format_table, pass_at_k, save_results, table_row


def test_pass_at_k_equals_hand_computation():
    # n=5 runs, c=2 correct, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # k=1 is the fraction correct
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    # n=4, c=1, k=3: 1 - C(3,3)/C(4,3) = 1 - 1/4
    assert pass_at_k(4, 1, 3) == pytest.approx(0.75)
    # fewer wrong runs than k: some draw of k always holds a correct one
    assert pass_at_k(4, 2, 3) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_pass_at_k_matches_the_combinatorial_definition():
    """Exhaustive check: the probability that a random k-subset of n runs contains a
    correct one, counted by enumerating subsets."""
    from itertools import combinations

    for n in range(1, 7):
        for c in range(n + 1):
            runs = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(combinations(range(n), k))
                hits = sum(any(runs[i] for i in s) for s in subsets)
                assert pass_at_k(n, c, k) == pytest.approx(float(Fraction(hits, len(subsets))))


def test_table_row_averages_questions():
    # two questions, n = 4 sampled runs each: 1 and 3 correct; greedy right on the first
    greedy = [(True, 10), (False, 20)]
    sampled = [
        [(True, 8), (False, 12), (False, 10), (False, 10)],
        [(True, 30), (True, 30), (True, 30), (False, None)],
    ]
    row = table_row("toy", greedy, sampled, [1, 2, 4])
    assert row["dataset"] == "toy" and row["num_questions"] == 2
    assert row["greedy_acc"] == 0.5 and row["greedy_length"] == 15.0
    assert row["sample_length"] == pytest.approx((8 + 12 + 10 + 10 + 30 * 3) / 7)
    assert row["sample_pass@1"] == pytest.approx((1 / 4 + 3 / 4) / 2)
    # hand: q1 (n=4,c=1,k=2) = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5; q2 (c=3) = 1.0
    assert row["pass@2"] == pytest.approx((0.5 + 1.0) / 2)
    assert row["pass@1"] == pytest.approx(row["sample_pass@1"])
    assert row["pass@4"] == 1.0


def test_table_is_printed_and_saved(tmp_path):
    rows = [
        table_row("a", [(True, 3)], [[(True, 3), (False, 5)]], [1, 2]),
        table_row("b", [], [[(False, None), (False, None)]], [1, 2]),
    ]
    text = format_table(rows)
    header, first, second = text.splitlines()
    assert header.split() == [
        "dataset",
        "num_questions",
        "greedy_length",
        "sample_length",
        "greedy_acc",
        "sample_pass@1",
        "pass@1",
        "pass@2",
    ]
    assert first.split() == ["a", "1", "3.0", "4.0", "1.0000", "0.5000", "0.5000", "1.0000"]
    assert second.split()[2:5] == ["-", "-", "-"]
    json_path, csv_path = save_results(rows, tmp_path / "out")
    assert json.loads(json_path.read_text()) == rows
    with csv_path.open() as f:
        saved = list(csv.DictReader(f))
    assert [r["dataset"] for r in saved] == ["a", "b"] and saved[0]["pass@2"] == "1.0"
