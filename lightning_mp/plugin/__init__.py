"""The Precision plugin: :class:`MixedPrecision` adapts Lightning's ``Precision`` interface to a run's pieces.

* :mod:`~lightning_mp.plugin.mixed_precision`: the plugin, Lightning's hooks handed to the run's step engine;
* :mod:`~lightning_mp.plugin.resolved`: what setup resolves once (the device, ``"auto"``, the precision shown);
* :mod:`~lightning_mp.plugin.run`: the factory of a run's policy, loss scaler, FP8 and engine;
* :mod:`~lightning_mp.plugin.checkpoint`: the checkpoint entry, and the other plugins' entries it resumes from;
* :mod:`~lightning_mp.plugin.claims`: one run at a time per plugin, across threads;
* :mod:`~lightning_mp.front_ends`: the Trainer or Fabric, and the device a run sets up on;
* :mod:`~lightning_mp.plugin.fp8`: the FP8 methods.
"""

from lightning_mp.plugin.mixed_precision import MixedPrecision

__all__ = ["MixedPrecision"]
