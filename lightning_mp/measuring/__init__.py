"""What the monitors and the advisors share to measure a model, below the plugin and FP8.

* :mod:`~lightning_mp.measuring.logging_steps`: the step Lightning logs a batch at, and writing to its loggers;
* :mod:`~lightning_mp.measuring.host_reads`: one device-to-host transfer per batch for every monitor together;
* :mod:`~lightning_mp.measuring.heatmaps`: per-layer heatmaps over steps, drawn for TensorBoard;
* :mod:`~lightning_mp.measuring.monitors`: the monitors' skeletons (the end-of-batch hook, the sampled monitor);
* :mod:`~lightning_mp.measuring.trial_batches`: the advisors' measuring run on a copy of the model.

Nothing here imports the plugin or FP8, so both the callbacks and :mod:`lightning_mp.fp8` build on it.
"""
