"""An experiment's files: points.csv (every point), clients.csv (every client at every point),
the plot, and summary.md (the paper's claim, the command, the scale, the wall time, the points
and the claim-by-claim table)."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edge_runtime._io import read_json_cache, to_json_types, write_text_atomic
from experiments import benchmark_support as C
from experiments.spec import Claim, Experiment, ExperimentError, Result

SUMMARY_FILE = "summary.md"
SETTINGS_FILE = "report.json"  # what a folder's report was measured with
MAX_SETTINGS_BYTES = 1 << 20  # a few kB of flags


def refuse_other_report(folder: Path, settings: dict[str, Any], command: str) -> None:
    """Stop before anything is trained when `folder` holds a report measured with other
    settings (data, scale, grids, seeds, kNN-Per's request): running on would replace it."""
    # the bounded reader (regular file, size, UTF-8, nesting, numbers): a damaged one is one
    # warning line and nothing to compare with, so the report is remade
    saved = read_json_cache(folder / SETTINGS_FILE, limit=MAX_SETTINGS_BYTES)
    if saved is not None and saved.get("settings") != to_json_types(settings):
        raise ExperimentError(
            f"{folder} holds a report made with other flags "
            f"(`{saved.get('command')}`), not `{command}`; choose another "
            "--out, or add --force to replace that report"
        )


def pyplot():
    """matplotlib's pyplot on the Agg backend: plots are saved as PNG, never shown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish_axes(
    ax: Any, title: str | None = None, *, percent_y: bool = True, legend: bool = True
) -> None:
    """What every experiment plot shares: accuracy ticks in %, a grid, the legend beside the
    axes (never over the data) and a title that states the claim."""
    from matplotlib.ticker import PercentFormatter

    if percent_y:
        ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    if title:
        ax.set_title(title, fontsize=9)


ERROR_BARS = "bars: +-1 s.d. across seeds"


def draw(
    ax: Any,
    x: Sequence[Any],
    y: Sequence[float],
    fmt: str,
    std: Sequence[float | None] | None = None,
    **style: Any,
) -> Any:
    """A curve; with bars of +- one standard deviation where its points carry one (the
    across-seed `COLUMN_std` of `knnper experiment --seeds`), said in its legend entry."""
    if std is None or all(s is None for s in std):
        return ax.plot(x, y, fmt, **style)[0]
    if "label" in style:
        style["label"] = f"{style['label']} ({ERROR_BARS})"
    return ax.errorbar(x, y, yerr=[s or 0.0 for s in std], fmt=fmt, capsize=3, **style).lines[0]


def fit_y(
    ax: Any,
    values: Sequence[float | None],
    std: Sequence[float | None] = (),
    *,
    percent: bool = True,
) -> tuple[float, float]:
    """A y axis fitted to the data (and their error bars), so the effect being judged is not
    squeezed into a corner of 0-100%; the label says the range, since it no longer starts at
    0. Returns the limits."""
    stds = list(std) or [None] * len(values)
    spread = [(v, s or 0.0) for v, s in zip(values, stds, strict=True) if v is not None]
    lo = min(v - s for v, s in spread)
    hi = max(v + s for v, s in spread)
    pad = max((hi - lo) * 0.1, 0.005 if percent else 1e-3)
    lo, hi = lo - pad, hi + pad
    if percent:
        lo, hi = max(lo, 0.0), min(hi, 1.0)
    ax.set_ylim(lo, hi)
    shown = f"{100 * lo:.0f}% to {100 * hi:.0f}%" if percent else f"{lo:.3g} to {hi:.3g}"
    ax.set_ylabel(f"{ax.get_ylabel()}\n(axis {shown}, fitted to the data)")
    return lo, hi


def save_figure(fig: Any, path: Path, scale: str) -> Path:
    """The figure as PNG, its data set and scale under the title (every figure says what it
    was measured on)."""
    title, scale = fig.get_suptitle(), textwrap.fill(scale, 120)
    fig.suptitle(f"{title}\n{scale}" if title else scale, fontsize=8 if not title else 10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    pyplot().close(fig)
    return path


def claims_table(claims: Sequence[Claim]) -> list[str]:
    """The claim-by-claim table's markdown lines."""
    return [
        "| the paper | we measured | verdict |",
        "|---|---|---|",
        *(f"| {c.paper} | {c.ours} | {c.verdict} |" for c in claims),
    ]


def write_report(
    experiment: Experiment,
    result: Result,
    out: Path,
    *,
    command: str,
    scale_line: str,
    started: float,
    settings: dict[str, Any],
) -> Path:
    """Write points.csv, clients.csv, summary.md and the settings they were measured with
    (refuse_other_report reads them) into `out`; returns the summary's path."""
    C.write_csv(out / "points.csv", result.points, result.point_columns)
    if result.clients:
        C.write_csv(out / "clients.csv", result.clients, result.client_columns)
    computed = (
        result.compute_seconds
        if result.compute_seconds is not None
        else sum(float(p.get("seconds") or 0) for p in result.points)
    )
    lines = [
        f"# Experiment: {experiment.name}",
        "",
        f"**The paper:** {experiment.claim}",
        "",
        f"Command: `{command}`",
        "",
        f"Scale: {scale_line}.",
        "",
        f"Wall time of this invocation: {time.perf_counter() - started:.0f} s; compute time of "
        f"its points as recorded when each was computed (by this or an earlier, interrupted "
        f"invocation; a point that first needed a global model includes its training, a "
        f"model trained by another experiment is not counted): {computed:.0f} s. Machine: "
        f"{C.machine_line(C.machine_info())}.",
        "",
        "## Claims",
        "",
        *claims_table(result.claims),
        "",
        f"![{experiment.name}]({result.plot.name})",
        "",
        "## Points",
        "",
        C.markdown_table(result.points, result.table),
        "",
        *(f"{note}\n" for note in result.notes),
        "Files: points.csv (every point)"
        + (", clients.csv (every client at every point)" if result.clients else "")
        + f", {result.plot.name}.",
        "",
    ]
    path = out / SUMMARY_FILE
    write_text_atomic(path, "\n".join(lines))
    C.write_json(out / SETTINGS_FILE, {"command": command, "settings": settings})
    return path


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Rank correlation (None with fewer than 3 points or a constant side)."""
    from scipy.stats import spearmanr

    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    return float(spearmanr(x, y).statistic)
