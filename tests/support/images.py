"""Checks on plots the models write (matplotlib PNGs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["check_png"]


def check_png(path: Path) -> None:
    """``path`` is a plot of at least 500×400 pixels with plotted content: many distinct
    colours, and coloured (not grey) pixels of the series."""
    import matplotlib.image as mpimg

    assert path.stat().st_size > 10_000
    img = mpimg.imread(path)
    assert img.shape[0] >= 400 and img.shape[1] >= 500
    rgb = img[..., :3]
    colourful = (np.abs(rgb[..., 0] - rgb[..., 2]) > 0.2).mean()
    assert colourful > 0.002, "no plotted series"
    assert len(np.unique(rgb.reshape(-1, 3).round(2), axis=0)) > 20
