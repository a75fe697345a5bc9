"""Per-layer heatmaps over steps, drawn with matplotlib's Agg canvas into an RGB array for TensorBoard.

No ``pyplot``: a :class:`matplotlib.figure.Figure` on its own :class:`~matplotlib.backends.backend_agg.FigureCanvasAgg`
touches no global state and needs no display, so it is safe inside training, in workers and in notebooks.
matplotlib is imported on first use; :func:`require_matplotlib` says how to install it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class HeatmapStyle:
    """How one quantity is drawn: its title, colour bar label, colour map and range."""

    title: str
    label: str
    colormap: str
    low: float
    high: float


def require_matplotlib(callback_name: str) -> None:
    """Fail early, with the fix, when matplotlib is missing.

    Raises:
        ModuleNotFoundError: if matplotlib cannot be imported.

    """
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"`{callback_name}(log_heatmaps=True)` draws its heatmaps with matplotlib, which is not installed."
            " Run `pip install matplotlib`, or pass `log_heatmaps=False`."
        ) from error


def heatmap_figure(
    style: HeatmapStyle, layers: Sequence[str], steps: Sequence[int], values: Sequence[Sequence[float]]
) -> Figure:
    """Draw ``values[layer][sample]`` as a heatmap, layers down and steps across; NaN cells stay blank.

    The figure uses matplotlib's constrained layout, which makes room for everything drawn around the axes: the layer
    names on the left, the colour bar with its label on the right (``tight_layout`` leaves the colour bar out, and cut
    its label off at the right edge), and the title above, centred on the figure.

    Returns:
        The drawn figure, on its own Agg canvas.

    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    grid = np.array(
        [[value if math.isfinite(value) else math.nan for value in row] for row in values], dtype=np.float64
    )
    grid = np.clip(grid, style.low, style.high)
    size = (min(4 + 0.25 * len(steps), 12), min(1.5 + 0.25 * len(layers), 12))
    figure = Figure(figsize=size, dpi=80, layout="constrained")
    canvas = FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    image = axes.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=style.colormap, vmin=style.low, vmax=style.high)
    # Over the whole figure, not the axes: long layer names push the axes right, and a title centred on them ran off.
    figure.suptitle(style.title)
    axes.set_xlabel("step")
    axes.set_yticks(range(len(layers)), labels=list(layers), fontsize=7)
    ticks = range(0, len(steps), max(1, len(steps) // 8))
    axes.set_xticks(list(ticks), labels=[str(steps[index]) for index in ticks], fontsize=7)
    figure.colorbar(image, ax=axes, label=style.label)
    canvas.draw()
    return figure


def render_heatmap(
    style: HeatmapStyle, layers: Sequence[str], steps: Sequence[int], values: Sequence[Sequence[float]]
) -> np.ndarray:
    """:func:`heatmap_figure` as an image.

    Returns:
        An ``(height, width, 3)`` uint8 image, as ``SummaryWriter.add_image(..., dataformats="HWC")`` takes it.

    """
    canvas = heatmap_figure(style, layers, steps, values).canvas
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()  # type: ignore[attr-defined]  # Agg canvas; FigureCanvasBase lacks it
