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


def test_seeds_average_only_when_every_seed_reached_the_threshold() -> None:
    from benchmarks.time_to_accuracy import curve, leg_key, threshold_times

    assert leg_key("shared-ours_vllm-seed3") == ("shared", "ours_vllm", 3)
    seeds = {1: LEG, 2: [{"t": 50.0, "accuracy": 0.9}, {"t": 90.0, "accuracy": 0.95}]}
    assert threshold_times(seeds, 0.875) == (75.0, 50.0, 100.0, 2)
    assert threshold_times(seeds, 0.95) == (110.0, 90.0, 130.0, 2)
    mean, lo, hi, n = threshold_times(seeds, 0.96)  # seed 2 never got there
    assert (mean, lo, hi, n) == (None, 130.0, 130.0, 1)
    assert curve(seeds, [20.0, 60.0, 100.0]) == [None, (0.7, 0.5, 0.9), (0.925, 0.9, 0.95)]


def test_report_ratio_is_a_lower_bound_when_trl_never_got_there() -> None:
    from benchmarks.time_to_accuracy import report

    ours = [{"t": 60.0, "accuracy": 0.9}, {"t": 120.0, "accuracy": 0.96}]
    trl = [{"t": 90.0, "accuracy": 0.9}, {"t": 300.0, "accuracy": 0.94}]
    text = report({"seq-ours-seed1": ours, "seq-trl-seed1": trl}, budget_s=480.0)
    ratios = text.splitlines()[-1]
    assert ratios == "| seq, ours | 1.50x | 2.50x | >= 4.00x | - |", ratios
