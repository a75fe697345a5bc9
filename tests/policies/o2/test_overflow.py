"""O2 in fp16 names the fp32 weights beyond fp16's range, whose model parameters would be inf: at setup, and after the
step such a weight made skip; bf16 has fp32's range."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_mp.policies.o2 import HalfOverflowError
from tests.helpers import fit, hook_count
from tests.policies.o2.helpers import Net, o2


def test_o2_fp16_refuses_a_weight_beyond_fp16_range_at_setup() -> None:
    """A finite fp32 weight beyond 65504 is reported by name before training, instead of becoming an inf fp16 copy."""
    model = Net()
    with torch.no_grad():
        model.net[3].weight[0, 0] = 1e5
    with pytest.raises(HalfOverflowError, match=r"net\.3\.weight \(max \|w\| = 1e\+05\).*bf16"):
        fit(model, o2("16-mixed"), max_steps=1)
    assert model.net[3].weight.dtype == torch.float32 and hook_count(model) == 0


class GrowsHead(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            with torch.no_grad():
                pl_module.net[0].weight[0, 0] = 7e4


def test_o2_fp16_names_a_weight_that_grows_beyond_fp16_range_during_training() -> None:
    """A weight pushed beyond 65504 mid-training: the skipped step's report names it instead of blaming gradients."""
    with pytest.raises(HalfOverflowError, match=r"net\.0\.weight") as error:
        fit(Net(), o2("16-mixed"), max_steps=3, callbacks=[GrowsHead()])
    assert error.value.names == ["net.0.weight"]


def test_o2_bf16_accepts_large_weights() -> None:
    """bf16 has fp32's range: a weight of 1e5 is no overflow and trains."""
    model = Net()
    with torch.no_grad():
        model.net[3].weight[0, 0] = 1e5
    assert fit(model, o2("bf16-mixed"), max_steps=1).precision_plugin.stats.skipped_steps == 0
