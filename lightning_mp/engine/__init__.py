"""The step engines: one contract (:mod:`~lightning_mp.engine.base`), one engine per front end.

* :mod:`~lightning_mp.engine.base`: what a step is, and what both engines share (``StepEngine``);
* :mod:`~lightning_mp.engine.trainer`: the Trainer's automatic and manual optimization (``TrainerEngine``);
* :mod:`~lightning_mp.engine.fabric`: Fabric's loop (``FabricEngine``), with the models it drives in
  :mod:`~lightning_mp.engine.fabric_models`;
* :mod:`~lightning_mp.engine.running_stats` and :mod:`~lightning_mp.engine.schedulers`: the running statistics a
  skipped iteration restores, and the schedulers a skipped step holds.

The engines are the package's internals: the plugin chooses one per run, and users meet neither.
"""
