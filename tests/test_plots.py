"""Plots that show the effect being judged: y axes fitted to the data with the range said,
the data set and scale in every title, FedAvg as a reference line, labelled error bars, and the
claim's ranges shaded only where something was measured."""

from __future__ import annotations

import pytest

from experiments import capacity, k_sigma, report

pytest.importorskip("matplotlib")


@pytest.fixture
def figures(monkeypatch):
    """The figures the plots would save, kept open for the test to read."""
    kept = []

    def keep(fig, path, scale):
        fig.suptitle(f"{fig.get_suptitle()}\n{scale}" if fig.get_suptitle() else scale)
        kept.append(fig)
        return path

    for module in (capacity, k_sigma):
        monkeypatch.setattr(module, "save_figure", keep)
    yield kept
    for fig in kept:
        report.pyplot().close(fig)


def test_a_fitted_axis_shows_a_few_points_of_difference_and_says_its_range():
    fig, ax = report.pyplot().subplots()
    ax.set_ylabel("accuracy (%)")
    lo, hi = report.fit_y(ax, [0.86, 0.91, None, 0.94], [0.01, None, None, 0.005])
    assert 0.83 < lo < 0.85 and 0.945 < hi < 0.96
    assert ax.get_ylim() == (lo, hi)
    assert f"axis {100 * lo:.0f}% to {100 * hi:.0f}%" in ax.get_ylabel()
    report.pyplot().close(fig)


def test_capacity_draws_fedavg_as_a_reference_line_not_a_point_of_the_curve(figures, tmp_path):
    points = [
        {"alpha": "0.3", "capacity": c, "all_mean": a}
        for c, a in ((0.0, 0.80), (0.2, 0.86), (1.0, 0.90))
    ]
    capacity._plot(points, tmp_path / "capacity.png", "digits, 8 clients (--quick)")
    ax = figures[0].axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    curve = lines["kNN-Per, alpha 0.3"]
    assert list(curve.get_xdata()) == [0.2, 1.0]  # x = 0 (FedAvg) is not joined to it
    fedavg = lines["FedAvg (no datastore), alpha 0.3"]
    assert set(fedavg.get_ydata()) == {0.80} and fedavg.get_color() == curve.get_color()
    assert ax.get_ylim()[0] > 0.7  # fitted: the 10 pp effect fills the axis
    assert "digits, 8 clients" in figures[0].get_suptitle()


def test_error_bars_say_what_they_are(figures, tmp_path):
    points = [
        {"alpha": "0.3", "capacity": c, "all_mean": a, "all_mean_std": 0.01}
        for c, a in ((0.0, 0.80), (0.2, 0.86), (1.0, 0.90))
    ]
    capacity._plot(points, tmp_path / "capacity.png", "3 seeds")
    labels = figures[0].axes[0].get_legend_handles_labels()[1]
    assert any(report.ERROR_BARS in label for label in labels)


@pytest.mark.parametrize(
    "ks, shaded", [((3, 5), False), ((5, 10, 20), False), ((5, 10, 14, 20), True)]
)
def test_k_sigma_shades_the_claims_k_range_only_over_measured_k(figures, tmp_path, ks, shaded):
    points = [{"k": k, "sigma": s, "all_mean": 0.9 - 0.001 * k} for k in ks for s in (1.0, 10.0)]
    k_sigma._plot(points, tmp_path / "k_sigma.png", "digits")
    left = figures[0].axes[0]
    labels = left.get_legend_handles_labels()[1]
    assert any("the claim's k range" in label for label in labels) == shaded
    if shaded:
        span = next(p for p in left.patches if "k range" in p.get_label())
        bbox = span.get_bbox()  # in data x (and axes y) coordinates
        assert (bbox.x0, bbox.x1) == (10, 14)  # the measured k inside [7, 14]
    styles = {
        (line.get_marker(), line.get_linestyle())
        for line in left.get_lines()
        if line.get_label().startswith("sigma")
    }
    assert len(styles) == 2  # two sigmas whose lines coincide still look different
