"""Headline numbers: which evaluations the final window averages and how that is said, and the
comparison table's columns."""

from flower_app.app.outcome import describe_window
from task.learning.metrics import final_window_mean, final_window_rounds


def test_a_window_longer_than_the_run_averages_and_names_the_rounds_that_exist():
    rounds, values = [1, 2, 3, 4, 5], [0.1, 0.2, 0.3, 0.4, 0.5]
    assert final_window_rounds(rounds, values, last_round=5, window=10) == [1, 2, 3, 4, 5]
    assert final_window_mean(rounds, values, last_round=5, window=10) == 0.3
    assert describe_window([1, 2, 3, 4, 5]) == "mean of rounds 1-5 (5 evaluations)"


def test_unmeasured_rounds_are_skipped_and_an_empty_window_falls_back_to_the_last_measurement():
    rounds, values = [10, 20, 30], [0.5, None, 0.7]
    assert final_window_rounds(rounds, values, last_round=30, window=15) == [30]
    assert final_window_rounds(rounds, [0.5, 0.6, None], last_round=30, window=5) == [20]
    assert final_window_mean(rounds, [0.5, 0.6, None], last_round=30, window=5) == 0.6
    assert final_window_rounds(rounds, [None, None, None], last_round=30, window=5) == []
    assert describe_window([20]) == "round 20" and describe_window([]) == "no evaluation"


def test_the_comparison_table_shows_a_column_only_where_a_variant_reports_it():
    from flower_app.results.comparison import comparison_table

    table = comparison_table({"fedavg": {"personalized_accuracy": 0.5, "official_local_accuracy": 0.8},
                              "fedrep": {"personalized_accuracy": 0.9}})
    header, _, fedavg, fedrep = table.splitlines()
    assert "official-code local acc" in header and "best-round local acc" not in header
    assert fedavg.endswith("| 0.5000 | 0.8000 |") and fedrep.endswith("| 0.9000 | n/a |")
