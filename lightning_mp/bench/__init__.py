"""The benchmark: what each precision setup costs in time, memory and host work, as Markdown tables.

``python -m lightning_mp.bench`` runs it (``--help`` lists the flags). One job per module:

- :mod:`~lightning_mp.bench.cli`: the command line, and which benchmark runs on what;
- :mod:`~lightning_mp.bench.configurations`: the precision setups compared (fp32 with and without TF32,
  Lightning's built-in plugins, ``MixedPrecision`` at each opt level, with and without the monitors);
- :mod:`~lightning_mp.bench.workloads` and :mod:`~lightning_mp.bench.models`: what is trained (the Markov-text model
  on the CPU; a 219M-parameter GPT-like LM, ResNet-50 and a launch-bound LM on CUDA, each with a tiny CPU shape);
- :mod:`~lightning_mp.bench.timing`: one timed run of a configuration: its step times, peak memory and host syncs,
  measured by the Trainer callbacks of :mod:`~lightning_mp.bench.step_callbacks`;
- :mod:`~lightning_mp.bench.comparison`: step time compared from paired, alternating, repeated runs in fresh
  processes;
- :mod:`~lightning_mp.bench.machine`: the machine and its load, which decide whether a timing can be trusted;
- :mod:`~lightning_mp.bench.report`: the timing report, its paired differences and the targets;
- :mod:`~lightning_mp.bench.memory`: tensor memory of one step, split by category (``--memory``);
- :mod:`~lightning_mp.bench.counts`: host syncs and ops of one iteration against torch's loop and Lightning's
  plugin (``--counts``);
- :mod:`~lightning_mp.bench.opt_level_counts`: weight casts, ops and Python calls of one step per opt level
  (``--counts``), with :mod:`~lightning_mp.bench.allreduced_bytes`: bytes DDP all-reduces per step (gloo).

``python -m lightning_mp.bench gpu-proof`` runs the GPU proof, one time-boxed command for a short GPU slot:

- :mod:`~lightning_mp.bench.proof`: the command, its parts and their shares, the versions and the JSON report;
- :mod:`~lightning_mp.bench.proof_boxes`: the time boxes, each part's child process and its status;
- :mod:`~lightning_mp.bench.smoke_matrix`: every precision x opt level x optimizer x front end skips a planted inf;
- :mod:`~lightning_mp.bench.outcome_log`: the pytest plugin that records each CUDA test's outcome as it is known;
- :mod:`~lightning_mp.bench.proof_figures`: the paired figures and their targets;
- :mod:`~lightning_mp.bench.proof_report`: the Markdown report, rendered from the JSON alone.
"""
