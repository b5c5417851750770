"""The rewards library: math-verify answer checking, exact and numeric matching, and
functions loaded by import path."""

from __future__ import annotations

import asyncio
import threading

import pytest

from areal_service.rewards import (
    exact_match,
    gsm8k_answer,
    last_number,
    load_reward,
    math_equal,
    math_reward,
    numeric_close,
    numeric_reward,
)


@pytest.mark.parametrize(
    ("prediction", "reference"),
    [
        ("The answer is \\boxed{42}.", "42"),
        ("Natalia sold 48/2 = 24 clips. 48+24 = 72\n#### 72", "#### 72"),
        ("so she pays $\\frac{1}{2}$ dollar", "0.5"),
        ("\\boxed{\\dfrac{3}{4}}", "0.75"),
        ("The farm has 1,000 sheep.", "She counts them all. #### 1,000"),
        ("so $x = \\sqrt{4}$", "2"),
    ],
)
def test_math_equal_accepts_equivalent_answers(prediction: str, reference: str):
    assert math_equal(prediction, reference)


@pytest.mark.parametrize(
    ("prediction", "reference"),
    [
        ("The answer is \\boxed{41}.", "42"),
        ("first 72, then 3", "#### 72"),  # the last number is the answer
        ("I don't know", "7"),
        ("", "7"),
        ("\\boxed{\\frac{1}{3}}", "0.33"),
    ],
)
def test_math_equal_rejects_wrong_answers(prediction: str, reference: str):
    assert not math_equal(prediction, reference)


def test_math_reward_reads_the_sample_answer_and_works_off_the_main_thread():
    sample = {"answer": "He buys 3 packs of 4. #### 12"}
    assert math_reward("3 * 4 = 12 #### 12", sample) == 1.0
    assert math_reward("#### 13", sample) == 0.0
    assert math_reward(None, sample) == 0.0
    assert math_reward("12", {}) == 0.0
    # The driver's agents run in threads and event loops: no SIGALRM there.
    out: list[float] = []
    thread = threading.Thread(target=lambda: out.append(math_reward("\\boxed{12}", sample)))
    thread.start()
    thread.join()
    assert out == [1.0]


def test_gsm8k_answer_marker():
    assert gsm8k_answer("a\n#### 1,234.") == "1234"
    assert gsm8k_answer("#### 5 #### 6") == "6"
    assert gsm8k_answer("no marker 5") is None


def test_exact_match_normalises_space_case_and_final_period():
    assert exact_match("  Paris. ", "paris")
    assert not exact_match("Paris", "paris", case_sensitive=True)
    assert not exact_match("Paris, France", "Paris")


def test_numeric_tolerance():
    assert last_number("costs 1,234.50 then -3e2") == -300.0
    assert last_number("none") is None
    assert numeric_close("about 3.14159", 3.1416, rel_tol=1e-4)
    assert not numeric_close("about 3.14159", 3.1416, rel_tol=1e-7, abs_tol=0)
    assert numeric_close("#### 42", "#### 42.0")
    assert numeric_reward("it is 10.001", {"answer": "10", "abs_tol": 0.01}) == 1.0
    assert numeric_reward("it is 10.1", {"answer": "10", "abs_tol": 0.01}) == 0.0


def test_load_reward_by_builtin_name_and_import_path(tmp_path, monkeypatch):
    assert load_reward("math") is math_reward
    assert load_reward("areal_service.rewards.match:numeric_reward") is numeric_reward
    assert (
        load_reward("areal_service.rewards.match.exact_match_reward")("a", {"answer": "A"}) == 1.0
    )
    # a user's async function in their own module: the caller awaits it
    (tmp_path / "my_rewards.py").write_text(
        "async def judge(completion, sample):\n    return 0.5\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward("my_rewards:judge")
    assert asyncio.run(fn("x", {"answer": "x"})) == 0.5
    for bad in (
        "nope",
        "no_such_module:f",
        "areal_service.rewards:nothing",
        "areal_service.rewards.math:PARSE_TIMEOUT_S",
    ):
        with pytest.raises(ValueError):
            load_reward(bad)
