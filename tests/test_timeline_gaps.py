"""runtime/timeline.idle_gaps: where the compute stream sat idle in a step (bench_megatrain.py --gaps), from the
engine's labelled spans; CUDA events themselves need a GPU, the interval arithmetic does not."""

from megatrain.runtime.timeline import idle_gaps


def test_idle_gaps_are_the_uncovered_stretches_longest_first_with_their_neighbours():
    spans = [(5.0, 10.0, "forward (1,)"), (0.0, 4.0, "embed (0,)"), (8.0, 12.0, "forward (2,)"),
             (20.0, 25.0, "head (3, 4)")]  # out of order, one overlapping its predecessor
    gaps = idle_gaps(spans, 30.0)
    assert gaps == [{"ms": 8.0, "after": "forward (2,)", "before": "head (3, 4)"},
                    {"ms": 5.0, "after": "head (3, 4)", "before": ""},
                    {"ms": 1.0, "after": "embed (0,)", "before": "forward (1,)"}]
    assert sum(g["ms"] for g in gaps) == 30.0 - 16.0  # the window less the union of the spans
    assert idle_gaps([(2.0, 30.0, "x")], 30.0) == [{"ms": 2.0, "after": "", "before": "x"}]
    assert idle_gaps([], 3.0) == [{"ms": 3.0, "after": "", "before": ""}]
