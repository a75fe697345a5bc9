"""The plugin's FP8 methods: convert the chosen linear layers, name them, and return some to bf16 mid-run.

With ``MixedPrecision("bf16-mixed", fp8=...)`` the run's linear layers compute their matmuls in FP8 with torchao's
float8 training (:mod:`lightning_mp.fp8`). The layers are converted when the plugin converts the model, before the
opt level does (O2 finds them there). Under FSDP2 torchao must convert them before ``fully_shard``, so
:meth:`Fp8Methods.fp8_convert` converts them in ``configure_model``, and the run takes those layers over at setup. A
layer whose FP8 matmuls misbehave returns to bf16 for the rest of the run (:meth:`Fp8Methods.fallback_layers`), the
same on every rank, and the checkpoint keeps the decision.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from lightning_mp.fp8.mode import Fp8Mode, warn_if_fallback_unwatched
from lightning_mp.fp8.settings import FP8Settings
from lightning_mp.front_ends import attached_trainer
from lightning_mp.plugin.run import Run
from lightning_mp.scaling.sharded import has_sharded_parameters


class Fp8Methods:
    """:class:`~lightning_mp.MixedPrecision`'s FP8 methods, over the FP8 mode of its run (module docstring)."""

    fp8_settings: FP8Settings | None
    keep_fp32: list[type | str]
    _run: Run | None
    _fp8_before_sharding: Fp8Mode | None

    @property
    def _fp8(self) -> Fp8Mode | None:
        """The run's FP8 mode; None before setup and without ``fp8``."""
        return self._run.fp8 if self._run is not None else None

    def _convert_fp8(self, module: nn.Module) -> None:
        """Convert the chosen linear layers to FP8 before the opt level converts the module (O2 finds them there).

        Raises:
            ValueError: for a model FSDP2 sharded before the plugin saw it: torchao must convert before sharding.

        """
        fp8 = self._fp8
        if fp8 is None or fp8.converted(module):
            return
        if has_sharded_parameters(module):
            raise ValueError(
                f"{self!r} with fp8={fp8.settings.recipe!r} got a model FSDP2 sharded already: torchao converts"
                " linear layers before fully_shard, not after. Use plugin.fp8_convert(self) first thing in"
                " configure_model, before fully_shard (or in fabric.setup's parallelize_fn)."
            )
        if fp8.settings.fsdp_float8_all_gather:
            raise ValueError(
                f"{self!r} has FP8Settings(fsdp_float8_all_gather=True) on a model FSDP2 does not shard: the float8"
                " all-gather is FSDP2's. Call plugin.fp8_convert(self) in configure_model before fully_shard, or set"
                " fsdp_float8_all_gather=False."
            )
        fp8.convert(module, self.keep_fp32)
        trainer = attached_trainer(module)
        if trainer is not None:
            warn_if_fallback_unwatched(fp8.settings, trainer.callbacks)

    def fp8_convert(self, module: nn.Module) -> nn.Module:
        """Convert ``module``'s chosen linear layers to FP8 now, for FSDP2: call it before ``fully_shard``.

        torchao's layers must exist before FSDP2 shards their weights (its float8 all-gather wraps them), so under
        ``ModelParallelStrategy`` the conversion cannot wait for the plugin's own ``convert_module``::

            def configure_model(self):
                plugin.fp8_convert(self)
                for block in self.blocks:
                    fully_shard(block, mp_policy=plugin.fsdp2_policy())
                fully_shard(self, mp_policy=plugin.fsdp2_policy())

        A sharded model keeps its FP8 layers after fit (it is not a plain model anyway), and its layers cannot fall
        back mid-run (FSDP2 holds the layer objects); :class:`~lightning_mp.fp8.FP8Settings` ``exclude`` keeps them
        out from the start.

        Returns:
            ``module``, converted in place.

        Raises:
            RuntimeError: when the plugin has no ``fp8``.

        """
        if self.fp8_settings is None:
            raise RuntimeError(f"{self!r}.fp8_convert(...) needs fp8: pass MixedPrecision('bf16-mixed', fp8=...).")
        self._fp8_before_sharding = Fp8Mode(self.fp8_settings)
        self._fp8_before_sharding.convert(module, self.keep_fp32)
        return module

    @property
    def fp8_layers(self) -> list[str]:
        """Names of the layers that compute in FP8 now (relative to the model the plugin converted); empty without."""
        return self._fp8.layers if self._fp8 is not None else []

    @property
    def fp8_fell_back(self) -> dict[str, str]:
        """Layer name -> reason, for the layers returned to bf16 in this run (a resumed checkpoint's included)."""
        return dict(self._fp8.fell_back) if self._fp8 is not None else {}

    def fallback_layers(self, model: nn.Module, requests: Mapping[str, str]) -> dict[str, str]:
        """Return FP8 layers to bf16 for the rest of the run, the same on every rank; see :mod:`lightning_mp.fp8.mode`.

        Each layer becomes a plain ``nn.Linear`` holding the same weight and bias Parameter objects, so the optimizer
        and its state are untouched. The decision is kept in checkpoints.

        .. warning:: Under DDP this runs one collective and reads it on the host: call it on every rank, at the same
            step (with an empty ``requests`` where a rank has none), on logging steps only.

        Args:
            model: the converted model: the LightningModule under the Trainer; under Fabric the module given to
                ``fabric.setup`` or the one it returned.
            requests: layer name -> reason, for the layers this rank would return to bf16.

        Returns:
            Layer name -> reason, for the layers that fell back now: the union of every rank's requests.

        Raises:
            RuntimeError: when the run has no FP8 (``fp8=None``), or before setup.
            ValueError: for a name that is not an FP8 layer of ``model``.

        """
        if self._fp8 is None:
            raise RuntimeError(
                f"{self!r}.fallback_layer(...) needs an FP8 run: pass MixedPrecision('bf16-mixed', fp8='tensorwise')"
                " (or another recipe), and call it after the Trainer or Fabric set the model up."
            )
        return self._fp8.fallback_layers(model, requests)

    def fallback_layer(self, model: nn.Module, name: str, reason: str) -> bool:
        """Return one FP8 layer to bf16 for the rest of the run (:meth:`fallback_layers` with one request).

        .. warning:: One collective under DDP: every rank must call it (or :meth:`fallback_layers`) at the same step.

        Returns:
            Whether ``name`` fell back now (False when it had fallen back already).

        """
        return name in self.fallback_layers(model, {name: reason})


__all__ = ["Fp8Methods"]
