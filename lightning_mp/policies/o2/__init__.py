"""O2: half model parameters for the forward and backward, fp32 master parameters for the optimizer's math.

:mod:`~lightning_mp.policies.o2.policy` teaches the algorithm; :mod:`~lightning_mp.policies.o2.selection` chooses the
parameters, :mod:`~lightning_mp.policies.o2.masters` keeps the fp32 masters beside them and moves values and
gradients between the two, :mod:`~lightning_mp.policies.o2.overflow` checks fp16's range.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from lightning_mp.policies.o2.masters import MasterParams
from lightning_mp.policies.o2.overflow import HalfOverflowError, overflowing_weights
from lightning_mp.policies.o2.policy import O2Policy
from lightning_mp.policies.o2.selection import computes_weights_in_fp32

__all__ = ["HalfOverflowError", "MasterParams", "O2Policy", "computes_weights_in_fp32", "overflowing_weights"]
