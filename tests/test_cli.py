"""LightningCLI: the plugin and the monitors configured from YAML, as in ``examples/cli_config.yaml``."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI

from lightning_mp import MixedPrecision
from lightning_mp.callbacks import GradientHealthMonitor, LayerDtypeMonitor, LossScaleMonitor
from lightning_mp.tasks import MarkovTextDataModule, TinyTransformerLM
from tests.helpers import read_events

# LightningCLI imports without jsonargparse but cannot parse anything: an install without the dev extra skips this.
pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse: pip install 'jsonargparse[signatures]'")

CONFIG = Path(__file__).parents[1] / "examples" / "cli_config.yaml"


def test_cli_yaml_with_plugin_and_monitors_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The example YAML builds MixedPrecision from class_path/init_args, attaches the monitors and trains."""
    monkeypatch.chdir(tmp_path)
    cli = LightningCLI(
        TinyTransformerLM,
        MarkovTextDataModule,
        args=[
            "fit",
            "--config",
            str(CONFIG),
            "--trainer.max_steps=3",
            "--trainer.limit_val_batches=1",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false",
            "--model.d_model=32",
            "--model.n_layers=1",
            "--model.seq_len=16",
            "--data.seq_len=16",
            "--data.batch_size=8",
        ],
    )
    trainer = cli.trainer
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MixedPrecision)
    assert (plugin.precision, plugin.opt_level) == ("16-mixed", "O1")
    assert plugin.scaler is not None and plugin.scaler.get_growth_interval() == 1000
    assert plugin.scaler.hysteresis == 2
    assert plugin.stats.optimizer_steps == trainer.global_step == 3
    kinds = {type(callback) for callback in trainer.callbacks}
    assert {LossScaleMonitor, GradientHealthMonitor, LayerDtypeMonitor} <= kinds
    events = read_events(trainer.logger.log_dir)
    assert "precision/loss_scale" in events.Tags()["scalars"]
