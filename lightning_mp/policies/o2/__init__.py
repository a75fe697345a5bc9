"""O2: half model parameters for the forward and backward, fp32 master parameters for the optimizer.

:mod:`~lightning_mp.policies.o2.policy` teaches the algorithm; :mod:`~lightning_mp.policies.o2.selection` chooses the
parameters, :mod:`~lightning_mp.policies.o2.parameters` keeps the pairs, :mod:`~lightning_mp.policies.o2.contexts`
shows one side or the other around the forward and backward, :mod:`~lightning_mp.policies.o2.overflow` checks fp16's
range.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from lightning_mp.policies.o2.overflow import HalfOverflowError, overflowing_weights
from lightning_mp.policies.o2.parameters import ParameterPairs
from lightning_mp.policies.o2.policy import O2Policy
from lightning_mp.policies.o2.selection import computes_weights_in_fp32

__all__ = ["HalfOverflowError", "O2Policy", "ParameterPairs", "computes_weights_in_fp32", "overflowing_weights"]
