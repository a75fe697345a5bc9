"""FP8 training on torchao's float8 linears, under the same plugin: ``MixedPrecision("bf16-mixed", fp8="tensorwise")``.

:mod:`~lightning_mp.fp8.settings` validates the FP8 settings, :mod:`~lightning_mp.fp8.selection` decides which linear
layers run FP8, :mod:`~lightning_mp.fp8.convert` adapts torchao's conversion (and undoes it), and
:mod:`~lightning_mp.fp8.mode` is the plugin's FP8 run: setup line, fallback, checkpoints, teardown. Importing this
package needs no torchao; the plugin asks for it when ``fp8`` is given.
"""

from typing import Any

from lightning_mp.fp8.convert import fp8_layer_names
from lightning_mp.fp8.mode import FP8_OPT_LEVELS
from lightning_mp.fp8.settings import RECIPES, Fp8Recipe, FP8Settings

__all__ = [
    "FP8_OPT_LEVELS",
    "RECIPES",
    "FP8Advice",
    "FP8Monitor",
    "FP8Settings",
    "FallbackRule",
    "Fp8Recipe",
    "advise_fp8",
    "fp8_layer_names",
]

_LATER = {
    "FP8Monitor": "lightning_mp.fp8.telemetry",
    "FallbackRule": "lightning_mp.fp8.telemetry_rules",
    "FP8Advice": "lightning_mp.fp8.advisor",
    "advise_fp8": "lightning_mp.fp8.advisor",
}
"""Names imported on first use: the monitor and the advisor import the plugin, which imports this package."""


def __getattr__(name: str) -> Any:
    if name in _LATER:
        import importlib

        return getattr(importlib.import_module(_LATER[name]), name)
    raise AttributeError(f"module 'lightning_mp.fp8' has no attribute {name!r}")
