"""FP8 training on torchao's float8 linears, under the same plugin: ``MixedPrecision("bf16-mixed", fp8="tensorwise")``.

:mod:`~lightning_mp.fp8.settings` validates the FP8 settings, :mod:`~lightning_mp.fp8.selection` decides which linear
layers run FP8, :mod:`~lightning_mp.fp8.convert` adapts torchao's conversion (and undoes it), and
:mod:`~lightning_mp.fp8.mode` is the plugin's FP8 run: setup line, fallback, checkpoints, teardown. Importing this
package needs no torchao; the plugin asks for it when ``fp8`` is given.
"""

from lightning_mp.fp8.convert import convert_to_fp8, fp8_layer_names, restore_linear
from lightning_mp.fp8.mode import FP8_OPT_LEVELS, Fp8Mode
from lightning_mp.fp8.selection import Fp8Selection, select_fp8_layers, summary_line
from lightning_mp.fp8.settings import RECIPES, Fp8Recipe, FP8Settings

__all__ = [
    "FP8_OPT_LEVELS",
    "RECIPES",
    "FP8Settings",
    "Fp8Mode",
    "Fp8Recipe",
    "Fp8Selection",
    "convert_to_fp8",
    "fp8_layer_names",
    "restore_linear",
    "select_fp8_layers",
    "summary_line",
]
