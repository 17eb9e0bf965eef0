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


def test_a_panel_without_data_says_so_instead_of_drawing_empty_axes():
    """A CPU run has no speedup (nothing was served): 06's speedup panel says so in the panel; a panel with data
    carries no such text; a training without evaluations says so in its held-out panel."""
    from eagle3kit.acceptance import compare

    cpu = {"run": "cpu", "offline_tau": 2.1, "offline_tau_steps1": 1.6, "offline_tau_steps3": 2.1}
    accept, speedup, by_run = compare.plot([cpu]).axes
    assert "no speedup measured" in " ".join(t.get_text() for t in speedup.texts)
    assert not speedup.lines and not speedup.get_yticks().size  # no scale suggesting values
    assert not accept.texts and not by_run.texts  # tau by steps and by run: data, no note
    gpu = {**cpu, "steps3_speedup": 0.9, "online_accept_length": 2.0}
    assert not compare.plot([gpu]).axes[1].texts
    trained_only = compare.plot([{"run": "t", "train_acc_pos0": 0.5}]).axes
    assert all(ax.texts for ax in trained_only)  # no sweep, no speedup, no acceptance bars: each says so
    log = [{"step": 1, "loss_pos0": 2.0}]
    loss, held = plots.train_curves(log, [], 1, "ce", 0.1).axes
    assert "no held-out evaluation" in held.texts[0].get_text() and not loss.texts


def test_the_capture_pace_plot_draws_each_interval_or_says_there_is_none():
    rows = [{"t": 60.0, "capture_tokens_per_s": 9000.0, "buffered": 40}, {"t": 120.0, "capture_tokens_per_s": 8000.0,
                                                                          "buffered": 55}]
    fig = plots.capture_pace(rows)
    ax, right = fig.axes
    assert list(ax.lines[0].get_ydata()) == [9000.0, 8000.0] and list(ax.lines[0].get_xdata()) == [1.0, 2.0]
    assert list(right.lines[0].get_ydata()) == [40, 55] and not ax.texts
    assert "no capture interval" in plots.capture_pace([]).axes[0].texts[0].get_text()
