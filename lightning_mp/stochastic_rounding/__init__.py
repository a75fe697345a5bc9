"""bf16 optimizer steps with stochastic rounding, and optional Kahan compensation, on top of torch's own optimizers.

A bf16 weight keeps 8 significant bits, so round-to-nearest loses every update smaller than half a gap and pure bf16
training stalls. Stochastic rounding rounds up with probability equal to the distance from the lower neighbour, so
each update is kept in expectation; Kahan compensation carries what the rounding dropped into the next step.
:class:`StochasticRoundingStep` attaches both to a user's ``Adam``, ``AdamW`` or ``SGD`` through torch's public hooks.

The package, by job:

- :mod:`~lightning_mp.stochastic_rounding.rounding`: the rounding in three tensor ops, and the share of updates a
  rounding loses;
- :mod:`~lightning_mp.stochastic_rounding.step`: the optimizer step, Kahan compensation and skipped steps;
- :mod:`~lightning_mp.stochastic_rounding.workspace`: the chunks, their fp32 workspace and torch's update rules;
- :mod:`~lightning_mp.stochastic_rounding.state`: the seed, the generators and the checkpointed state.
"""

from lightning_mp.stochastic_rounding.rounding import stale_update_share, stochastic_round_
from lightning_mp.stochastic_rounding.state import COMPENSATION_KEY, STATE_KEY
from lightning_mp.stochastic_rounding.state import check_rounding_state as check_rounding_state
from lightning_mp.stochastic_rounding.step import StochasticRoundingStep
from lightning_mp.stochastic_rounding.step import steps_bf16_parameters_itself as steps_bf16_parameters_itself
from lightning_mp.stochastic_rounding.workspace import MAX_CHUNKS, MIN_CHUNK_NUMEL, SUPPORTED_OPTIMIZERS, chunk_limit

__all__ = [
    "COMPENSATION_KEY",
    "MAX_CHUNKS",
    "MIN_CHUNK_NUMEL",
    "STATE_KEY",
    "SUPPORTED_OPTIMIZERS",
    "StochasticRoundingStep",
    "chunk_limit",
    "stale_update_share",
    "stochastic_round_",
]
