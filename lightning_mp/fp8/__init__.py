"""FP8 training on torchao's float8 linears, under the same plugin: ``MixedPrecision("bf16-mixed", fp8="tensorwise")``.

:mod:`~lightning_mp.fp8.settings` validates the FP8 settings, :mod:`~lightning_mp.fp8.selection` decides which linear
layers run FP8, :mod:`~lightning_mp.fp8.convert` adapts torchao's conversion (and undoes it), and
:mod:`~lightning_mp.fp8.mode` is the plugin's FP8 run: setup line, fallback, checkpoints, teardown.
:mod:`~lightning_mp.fp8.telemetry` is the FP8 monitor, :mod:`~lightning_mp.fp8.advisor` the FP8 advisor.

The package sits below the plugin: it builds on the core and on :mod:`lightning_mp.measuring` only, the plugin calls
its FP8 mode, and the one way back up is the two members of :class:`~lightning_mp.fp8.host.Fp8Host`.
Importing it needs no torchao; the plugin asks for it when ``fp8`` is given.
"""

from lightning_mp.fp8.advisor import FP8Advice, advise_fp8
from lightning_mp.fp8.convert import fp8_layer_names
from lightning_mp.fp8.mode import FP8_OPT_LEVELS
from lightning_mp.fp8.settings import RECIPES, Fp8Recipe, FP8Settings
from lightning_mp.fp8.telemetry import FP8Monitor
from lightning_mp.fp8.telemetry_rules import FallbackRule

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
