"""The verdict of one optimizer step: skipped or taken, as far as the host knows it, and the device's flag.

A step with an inf or NaN gradient is skipped. Who decides differs: the host, when it read the inf flag (fp16 with a
plain optimizer) or when nothing needed checking; the device, when a fused kernel got the flag and skips inside
itself (fused optimizers; bf16 and fp32 hand most steps to such a kernel). Reading the device's decision on the host
would synchronise with the device on every step, so a verdict carries both answers:

- ``skipped``: the host's answer now, which is what the opt level hears after the step;
- ``flag``: the device's 0-d inf flag (True or > 0 when skipped) where the device decided, else None.

The engine's ``last_step_skipped`` reads the flag where there is one (one sync, asked for); nothing on the step's
path does: :meth:`StepVerdict.any_of` combines an iteration's steps on the device, and the running statistics of a
skipped step go back with a ``torch.where`` on the flag (:class:`~lightning_mp.engine.running_stats.RunningStats`).

Example:
    >>> StepVerdict.of(True).skipped, StepVerdict.of(None).skipped
    (True, False)
    >>> on_device = StepVerdict.of(torch.tensor(1.0))
    >>> on_device.skipped, bool(on_device.flag)
    (False, True)
    >>> StepVerdict.any_of([StepVerdict.of(False), on_device]).flag
    tensor(True)

"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class StepVerdict:
    """Whether an optimizer step was skipped: the host's answer, and the device's flag where the device decided.

    One frozen type rather than a bool or a tensor: a bool of a device flag would synchronise the host on every
    step, a tensor made of every host answer would cost an op per step, and a type that is one or the other makes
    every consumer branch on it. The two answers a host knows without waiting are kept apart, and each consumer
    asks the verdict the question it has.

    Args:
        skipped: the host's answer now: True when the host saw the step skipped; False when it saw it taken, or
            did not look because the device decides (``flag``).
        flag: the device's inf flag (a 0-d tensor, True or > 0 when skipped) of a step the device decided; None
            where the host decided.

    """

    skipped: bool = False
    flag: Tensor | None = None

    @classmethod
    def of(cls, verdict: bool | Tensor | None) -> StepVerdict:
        """The verdict of the scaler's :meth:`~lightning_mp.LossScaler.step_verdict` (None: never checked, taken)."""
        if isinstance(verdict, Tensor):
            return cls(False, verdict)
        return SKIPPED if verdict else TAKEN

    @classmethod
    def after_kernel(cls, kernel_ran: bool, flag: bool | Tensor | None) -> StepVerdict:
        """The verdict of a step that knows whether the optimizer's kernel ran, with the device's flag where it decided.

        Under Fabric the host learns whether ``optimizer.step()`` ran from a step post-hook: a step the host
        skipped ran no kernel.
        """
        skipped = not kernel_ran
        if isinstance(flag, Tensor):
            return cls(skipped, flag)
        return SKIPPED if skipped else TAKEN

    @staticmethod
    def any_of(verdicts: Sequence[StepVerdict]) -> StepVerdict:
        """Whether any of an iteration's steps was skipped; device flags combined on the device, never read."""
        if any(verdict.skipped for verdict in verdicts):
            return SKIPPED
        flags = [verdict.flag for verdict in verdicts if verdict.flag is not None]
        if not flags:
            return TAKEN
        return StepVerdict(False, torch.stack([flag.float() for flag in flags]).amax() > 0)


TAKEN = StepVerdict(False)
"""The host saw the step taken (or there was nothing to check)."""
SKIPPED = StepVerdict(True)
"""The host saw the step skipped."""
