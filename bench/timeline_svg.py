"""A timeline picture as SVG (no plotting library on the bench machines): panels stacked
over one time axis, each with its own y scale, lines (optionally stepped or dashed) and
horizontal reference lines (an SLO). ``timeline_svg(panels, x_label)`` returns the document."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

WIDTH, PANEL_HEIGHT, LEFT, RIGHT, TOP, GAP = 960, 190, 70, 170, 30, 40


@dataclass(frozen=True)
class Series:
    name: str
    points: Sequence[tuple[float, float]]
    """(x, y) in x order; a y of nan leaves a gap."""
    color: str
    dashed: bool = False
    step: bool = False
    """Hold each value until the next point (counts), instead of joining them."""


@dataclass(frozen=True)
class Panel:
    title: str
    series: Sequence[Series]
    y_label: str
    references: Sequence[tuple[str, float]] = field(default=())
    """(label, y) horizontal lines, e.g. the SLO."""


def timeline_svg(panels: Sequence[Panel], x_label: str) -> str:
    xs = [x for panel in panels for s in panel.series for x, _ in s.points]
    x_max = max(xs, default=1.0) or 1.0
    height = TOP + len(panels) * (PANEL_HEIGHT + GAP) + 20
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
    ]
    for index, panel in enumerate(panels):
        top = TOP + index * (PANEL_HEIGHT + GAP)
        parts += _panel(panel, top, x_max, last=index == len(panels) - 1, x_label=x_label)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _panel(panel: Panel, top: float, x_max: float, last: bool, x_label: str) -> list[str]:
    ys = [y for s in panel.series for _, y in s.points if y == y]
    ys += [y for _, y in panel.references]
    y_max = max(ys, default=1.0) * 1.1 or 1.0
    plot_w = WIDTH - LEFT - RIGHT

    def at(x: float, y: float) -> str:
        return (
            f"{LEFT + x / x_max * plot_w:.1f},{top + PANEL_HEIGHT - y / y_max * PANEL_HEIGHT:.1f}"
        )

    out = [
        f'<text x="{LEFT}" y="{top - 8}" font-weight="bold">{escape(panel.title)}</text>',
        f'<rect x="{LEFT}" y="{top}" width="{plot_w}" height="{PANEL_HEIGHT}" fill="none" '
        'stroke="#999"/>',
        f'<text x="{LEFT - 8}" y="{top + 4}" text-anchor="end">{y_max:.3g}</text>',
        f'<text x="{LEFT - 8}" y="{top + PANEL_HEIGHT}" text-anchor="end">0</text>',
        f'<text x="14" y="{top + PANEL_HEIGHT / 2}" transform="rotate(-90 14 '
        f'{top + PANEL_HEIGHT / 2})" text-anchor="middle">{escape(panel.y_label)}</text>',
    ]
    for label, y in panel.references:
        a, b = at(0, y), at(x_max, y)
        out.append(f'<polyline points="{a} {b}" stroke="#c00" stroke-dasharray="2,4" fill="none"/>')
        out.append(f'<text x="{LEFT + 6}" y="{float(a.split(",")[1]) - 4:.1f}" fill="#c00">'
                   f"{escape(label)}</text>")  # fmt: skip
    for row, series in enumerate(panel.series):
        for run in _runs(series):
            dash = ' stroke-dasharray="6,3"' if series.dashed else ""
            out.append(
                f'<polyline points="{" ".join(at(x, y) for x, y in run)}" '
                f'stroke="{series.color}" stroke-width="1.6" fill="none"{dash}/>'
            )
        legend_y = top + 14 + row * 16
        out.append(
            f'<text x="{LEFT + plot_w + 6}" y="{legend_y}" fill="{series.color}">'
            f"{escape(series.name)}</text>"
        )
    if last:
        for tick in range(6):
            x = x_max * tick / 5
            out.append(
                f'<text x="{LEFT + tick / 5 * plot_w:.1f}" y="{top + PANEL_HEIGHT + 16}" '
                f'text-anchor="middle">{x:.0f}</text>'
            )
        out.append(
            f'<text x="{LEFT + plot_w / 2}" y="{top + PANEL_HEIGHT + 32}" '
            f'text-anchor="middle">{escape(x_label)}</text>'
        )
    return out


def _runs(series: Series) -> list[list[tuple[float, float]]]:
    """The series' points split at gaps (nan), stepped where asked."""
    runs: list[list[tuple[float, float]]] = [[]]
    previous: tuple[float, float] | None = None
    for x, y in series.points:
        if y != y:  # nan
            runs.append([])
            previous = None
            continue
        if series.step and previous is not None:
            runs[-1].append((x, previous[1]))
        runs[-1].append((x, y))
        previous = (x, y)
    return [run for run in runs if len(run) > 1]
