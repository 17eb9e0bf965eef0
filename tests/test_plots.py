"""Figures readable as measurements (#12): values on the bars, an axis that shows zeros, a log scale when the bars
would be slivers under a tolerance line, labelled axes."""
import matplotlib

matplotlib.use("Agg")

from eagle3kit import plots  # noqa: E402


def test_zero_bars_get_an_axis_and_their_values():
    ax = plots.bars([2, 15, 27], [0, 0, 0], "t", "max distance (bf16 ULP)", xlabel="layer slot").axes[0]
    assert ax.get_ylim() == (0, 1) and ax.get_ylabel() and ax.get_xlabel() == "layer slot"
    assert [t.get_text() for t in ax.texts] == ["0", "0", "0"]


def test_slivers_under_a_tolerance_line_switch_to_a_log_scale():
    ax = plots.bars([2, 15], [0.002, 0.004], "t", "relative error", threshold=0.1).axes[0]
    assert ax.get_yscale() == "log"
    ax = plots.bars([2, 15], [0.05, 0.08], "t", "relative error", threshold=0.1).axes[0]
    assert ax.get_yscale() == "linear" and ax.get_ylim()[1] >= 0.1
