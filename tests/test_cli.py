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


def fit_from_example_config(*overrides: str) -> LightningCLI:
    """Run ``fit`` from the example YAML on a tiny model for 3 steps, with ``overrides`` as extra CLI arguments."""
    return LightningCLI(
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
            *overrides,
        ],
    )


@pytest.mark.slow
def test_cli_yaml_with_plugin_and_monitors_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The example YAML builds MixedPrecision from class_path/init_args, attaches the monitors and trains."""
    monkeypatch.chdir(tmp_path)
    cli = fit_from_example_config()
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


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argument", "given", "message"),
    [
        ("precision", "fp16", r"MixedPrecision\(precision='fp16'\) .* Did you mean precision='16-mixed'\?"),
        ("precision", "16", r"MixedPrecision\(precision='?16'?\) .* Did you mean precision='16-mixed'\?"),
        ("precision", "16-mxied", r"MixedPrecision\(precision='16-mxied'\) .* Did you mean precision='16-mixed'\?"),
        ("precision", "bf16-true", r"MixedPrecision\(precision='bf16-true'\) .* Did you mean precision='bf16-mixed'\?"),
        ("on_min_scale", "Raise", r"MixedPrecision\(on_min_scale='Raise'\) .* Did you mean on_min_scale='raise'\?"),
        (
            "loss_scale",
            "Dynamic",
            r"MixedPrecision\(loss_scale='Dynamic'\) is not allowed: loss_scale must be 'dynamic'",
        ),
    ],
)
def test_a_wrong_value_in_the_cli_gets_the_plugins_own_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argument: str, given: str, message: str
):
    """fp16, 16 or a typo in the YAML or on the command line reaches the constructor, whose error names the fix."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        fit_from_example_config(f"--trainer.plugins.init_args.{argument}={given}")
