"""forewarn.chaos.exposition, the one reader of a /metrics body (the chaos suite's, the
demo's and the tests'): :func:`sample` matches labels exactly but in any order (the
exposition keeps the metric's declared label order, not sorted), escaped values are
unescaped, and an unlabelled sample is not confused with its labelled siblings;
:func:`total` sums the samples that carry the labels asked for."""

from __future__ import annotations

from forewarn.chaos.exposition import sample, samples, total

TEXT = """\
# HELP forewarn_x_total x
# TYPE forewarn_x_total counter
forewarn_x_total 3.0
forewarn_x_total{node="n1",gpu="0"} 5.0
forewarn_x_total{node="n1",gpu="1"} 7.0
forewarn_x_total{node="a \\"quoted\\" name",gpu="0"} 11.0
"""


def test_labels_match_in_any_order() -> None:
    assert sample(TEXT, "forewarn_x_total", gpu="1", node="n1") == 7.0
    assert sample(TEXT, "forewarn_x_total", node="n1", gpu="0") == 5.0


def test_an_unlabelled_sample_and_absent_ones() -> None:
    assert sample(TEXT, "forewarn_x_total") == 3.0
    assert sample(TEXT, "forewarn_x_total", node="n1") is None  # a subset is not a match
    assert sample(TEXT, "forewarn_y_total") is None


def test_escaped_label_values() -> None:
    assert sample(TEXT, "forewarn_x_total", node='a "quoted" name', gpu="0") == 11.0


def test_total_sums_every_sample_that_carries_the_labels() -> None:
    assert total(TEXT, "forewarn_x_total", node="n1") == 12.0
    assert total(TEXT, "forewarn_x_total", gpu="0") == 16.0
    assert total(TEXT, "forewarn_x_total") == 26.0
    assert total(TEXT, "forewarn_x_total", node="n2") is None
    assert total(TEXT, "forewarn_y_total") is None


def test_samples_lists_labels_and_values_in_text_order() -> None:
    assert samples(TEXT, "forewarn_x_total")[:2] == [({}, 3.0),
                                                     ({"node": "n1", "gpu": "0"}, 5.0)]
