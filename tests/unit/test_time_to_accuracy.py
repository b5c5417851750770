"""The time-to-accuracy benchmark's report arithmetic: a leg's accuracy at a mark is its
newest checkpoint by then, its time to a threshold the first checkpoint reaching it."""

from benchmarks.time_to_accuracy import accuracy_at, first_time

LEG = [{"t": 100.0, "accuracy": 0.9}, {"t": 10.0, "accuracy": 0.5}, {"t": 130.0, "accuracy": 0.96}]


def test_accuracy_at_a_mark_is_the_newest_checkpoint_by_then() -> None:
    assert accuracy_at(LEG, 5.0) is None
    assert accuracy_at(LEG, 99.9) == 0.5
    assert accuracy_at(LEG, 100.0) == 0.9
    assert accuracy_at(LEG, 1e9) == 0.96


def test_time_to_a_threshold_is_the_first_checkpoint_reaching_it() -> None:
    assert first_time(LEG, 0.875) == 100.0
    assert first_time(LEG, 0.95) == 130.0
    assert first_time(LEG, 0.975) is None
