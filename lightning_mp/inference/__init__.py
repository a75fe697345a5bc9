"""Inference export: a half-precision copy of a trained model, and a parity report against the fp32 original.

- :mod:`~lightning_mp.inference.convert`: :func:`to_inference`, the half-precision copy, optionally kept within an
  error budget;
- :mod:`~lightning_mp.inference.parity`: :func:`compare`, which runs both models on one batch and measures how far
  apart they are, end to end and layer by layer;
- :mod:`~lightning_mp.inference.reports`: :class:`ParityReport`, :class:`LayerParity` and :class:`ParityTable`, what
  the measurements return.
"""

from lightning_mp.inference.convert import to_inference
from lightning_mp.inference.parity import compare
from lightning_mp.inference.reports import LayerParity, ParityReport, ParityTable

__all__ = ["LayerParity", "ParityReport", "ParityTable", "compare", "to_inference"]
