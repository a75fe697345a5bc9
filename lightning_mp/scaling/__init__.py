"""The loss scaler's parts, one job per module, behind the facade :class:`~lightning_mp.scaler.LossScaler`.

* :mod:`~lightning_mp.scaling.rules`: the scaler's settings and its scale rules, as plain data and a pure function;
* :mod:`~lightning_mp.scaling.modes`: dynamic, static and check-only scaling as strategy objects, one chosen per
  scaler;
* :mod:`~lightning_mp.scaling.steps`: what the step knows of each optimizer, one record with its phase each, torch's
  per-optimizer protocol of one iteration (unscale once, step once) and where each step is decided;
* :mod:`~lightning_mp.scaling.verdict`: whether a step was skipped, as the host knows it and as the device decided;
* :mod:`~lightning_mp.scaling.kernels`: unscale and check an optimizer's gradients in a fixed number of ops;
* :mod:`~lightning_mp.scaling.sharded`: the inf check and gradient norms over sharded gradients (FSDP2, FSDP);
* :mod:`~lightning_mp.scaling.inf_flags`: the preallocated inf flags and the record of one iteration;
* :mod:`~lightning_mp.scaling.fused_steps`: skipping a step on the device, through torch's fused kernels;
* :mod:`~lightning_mp.scaling.device_rules`: the scale rules as device ops;
* :mod:`~lightning_mp.scaling.found_inf_copies`: host copies of the flags, read without a sync;
* :mod:`~lightning_mp.scaling.updates`: the host's update from each iteration, at once or one iteration late;
* :mod:`~lightning_mp.scaling.pending`: the statistics an iteration will leave, read before its update;
* :mod:`~lightning_mp.scaling.counters`: the counters and skip streaks;
* :mod:`~lightning_mp.scaling.nonfinite`: naming the parameters whose gradients were not finite;
* :mod:`~lightning_mp.scaling.checkpoint`: a scaler checkpoint, written and validated;
* :mod:`~lightning_mp.scaling.devices`: the device a scaler's tensors live on, and whether the run spans processes.
"""
