"""LayerDtypeMonitor: the per-layer dtype table and counts, and hooks that exist only on sampled steps."""

from __future__ import annotations

import csv
import pickle
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from tensorboard.backend.event_processing import event_accumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from lightning_mp.callbacks import LayerDtypeMonitor
from tests.helpers import fit, make_trainer, read_events

LEAF_MODULES = ("encoder.0", "encoder.1", "encoder.2", "criterion")


class HookCountingNetwork(LightningModule):
    """Linear, Tanh, Linear and an MSELoss module; records how many forward hooks it carries at each step.

    Not :class:`tests.helpers.TinyRegressor`: the table lists the leaf modules, and a loss module is one of them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.criterion = nn.MSELoss()
        self.forward_hooks_at_step: dict[int, int] = {}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.forward_hooks_at_step[self.global_step] = count_forward_hooks(self)
        features, target = batch
        return self.criterion(self.encoder(features), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 8, generator=generator), torch.randn(32, 1, generator=generator))
        return DataLoader(data, batch_size=4)


def count_forward_hooks(module: nn.Module) -> int:
    return sum(len(submodule._forward_hooks) for submodule in module.modules())


def fit_with_layer_dtype_monitor(
    logger: TensorBoardLogger | CSVLogger | bool,
    monitor: LayerDtypeMonitor,
    max_steps: int = 2,
    **trainer_kwargs: object,
) -> tuple[Trainer, HookCountingNetwork]:
    """A fresh :class:`HookCountingNetwork` fitted with ``monitor`` and ``logger``, logging every step, with a bf16
    MixedPrecision plugin unless ``trainer_kwargs`` give ``plugins``; the Trainer and the network."""
    trainer_kwargs.setdefault("plugins", [MixedPrecision("bf16-mixed")])
    model = HookCountingNetwork()
    trainer = fit(model, callbacks=[monitor], logger=logger, log_every_n_steps=1, max_steps=max_steps, **trainer_kwargs)
    return trainer, model


def tables(accumulator: event_accumulator.EventAccumulator) -> dict[int, dict[str, dict[str, str]]]:
    """Each logged table as {module name: {column: cell}}, by step."""
    parsed = {}
    for event in accumulator.Tensors("precision/layer_dtypes/text_summary"):
        lines = event.tensor_proto.string_val[0].decode().splitlines()
        header = [cell.strip() for cell in lines[0].strip("|").split("|")]
        rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
        parsed[event.step] = {row[0].strip("`"): dict(zip(header, row, strict=True)) for row in rows}
    return parsed


@pytest.fixture(scope="module")
def bf16_events(tmp_path_factory: pytest.TempPathFactory) -> event_accumulator.EventAccumulator:
    logger = TensorBoardLogger(tmp_path_factory.mktemp("bf16"))
    fit_with_layer_dtype_monitor(logger, LayerDtypeMonitor(every_n_steps=3), max_steps=7)
    return read_events(logger.log_dir)


def test_bf16_run_counts_layers_that_compute_in_bfloat16(bf16_events):
    """Under bf16 autocast the two Linear layers and the Tanh after them output bfloat16, and the counts say so."""
    counts = {event.step: event.value for event in bf16_events.Scalars("precision/layers/bfloat16")}
    assert counts[0] == 3
    assert {event.step: event.value for event in bf16_events.Scalars("precision/layers/float32")}[0] == 1


def test_table_has_one_row_per_leaf_module_with_its_dtypes(bf16_events):
    """The table lists every leaf module once, with fp32 weights and gradients (O1) and bf16 Linear outputs."""
    table = tables(bf16_events)[0]
    assert list(table) == list(LEAF_MODULES)
    first_linear = table["encoder.0"]
    assert first_linear["type"] == "Linear"
    assert (first_linear["parameters"], first_linear["output"], first_linear["gradients"]) == (
        "float32",
        "bfloat16",
        "float32",
    )
    assert table["encoder.1"]["parameters"] == "-"


def test_a_loss_under_autocast_shows_float32(bf16_events):
    """Autocast keeps the MSE loss in fp32, and the table shows that layer's output as float32."""
    criterion = tables(bf16_events)[0]["criterion"]
    assert (criterion["type"], criterion["output"]) == ("MSELoss", "float32")


def test_first_table_comes_at_the_first_step_then_every_n_steps(bf16_events):
    """With every_n_steps=3 the table is written at steps 0, 3 and 6, so the user sees it at once."""
    assert sorted(tables(bf16_events)) == [0, 3, 6]
    assert sorted(event.step for event in bf16_events.Scalars("precision/layers/bfloat16")) == [0, 3, 6]


def test_hooks_exist_only_during_sampled_steps(tmp_path):
    """Forward hooks are attached on sampled steps only and are all gone afterwards."""
    _, model = fit_with_layer_dtype_monitor(
        TensorBoardLogger(tmp_path), LayerDtypeMonitor(every_n_steps=2), max_steps=4
    )
    assert model.forward_hooks_at_step == {0: len(LEAF_MODULES), 1: 0, 2: len(LEAF_MODULES), 3: 0}
    assert count_forward_hooks(model) == 0


class TinyAttention(HookCountingNetwork):
    """Adds an nn.MultiheadAttention, a module with children that computes with parameters of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(embed_dim=8, num_heads=2, batch_first=True)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        features, target = batch
        attended, _ = self.attention(features[:, None], features[:, None], features[:, None])
        return self.criterion(self.encoder(attended[:, 0]), target)


def test_attention_projection_weights_are_in_the_table(tmp_path):
    """MultiheadAttention owns its input projection, so it gets a row; its out_proj is used without being called."""
    logger = TensorBoardLogger(tmp_path)
    trainer = make_trainer(
        MixedPrecision("bf16-mixed"), callbacks=[LayerDtypeMonitor()], logger=logger, log_every_n_steps=1, max_steps=1
    )
    trainer.fit(TinyAttention())
    table = tables(read_events(logger.log_dir))[0]
    assert (table["attention"]["type"], table["attention"]["parameters"]) == ("MultiheadAttention", "float32")
    assert table["attention"]["output"].startswith("bfloat16")
    assert table["attention.out_proj"]["output"] == "not called"
    assert list(table) == ["encoder.0", "encoder.1", "encoder.2", "criterion", "attention", "attention.out_proj"]


def test_o2_table_shows_half_parameters_with_their_fp32_masters_beside_half_outputs_and_gradients(tmp_path):
    """Under O2 the table shows fp16 parameters with their fp32 masters, fp16 outputs and fp16 gradients."""
    logger = TensorBoardLogger(tmp_path)
    fit_with_layer_dtype_monitor(
        logger, LayerDtypeMonitor(), max_steps=1, plugins=[MixedPrecision("16-mixed", opt_level="O2")]
    )
    table = tables(read_events(logger.log_dir))[0]
    linear = table["encoder.0"]
    assert (linear["parameters"], linear["output"], linear["gradients"]) == (
        "float16 (float32 master)",
        "float16",
        "float16",
    )


def test_works_with_lightnings_own_precision_flag(tmp_path):
    """The monitor needs no lightning_mp plugin: Lightning's precision='bf16-mixed' gets the same table."""
    logger = TensorBoardLogger(tmp_path)
    fit_with_layer_dtype_monitor(logger, LayerDtypeMonitor(), max_steps=1, plugins=None, precision="bf16-mixed")
    assert tables(read_events(logger.log_dir))[0]["encoder.2"]["output"] == "bfloat16"


def test_fp32_run_counts_every_layer_as_float32(tmp_path):
    """Without mixed precision every leaf module outputs float32 and no bfloat16 count appears."""
    logger = TensorBoardLogger(tmp_path)
    fit_with_layer_dtype_monitor(logger, LayerDtypeMonitor(), max_steps=1, plugins=[MixedPrecision("32-true")])
    accumulator = read_events(logger.log_dir)
    assert accumulator.Scalars("precision/layers/float32")[0].value == len(LEAF_MODULES)
    assert "precision/layers/bfloat16" not in accumulator.Tags()["scalars"]


def test_a_reused_monitor_writes_a_table_at_the_start_of_each_fit(tmp_path):
    """Fitting twice with the same monitor writes the first table of each run at its step 0."""
    monitor = LayerDtypeMonitor()
    first, second = TensorBoardLogger(tmp_path, name="first"), TensorBoardLogger(tmp_path, name="second")
    fit_with_layer_dtype_monitor(first, monitor, max_steps=1)
    fit_with_layer_dtype_monitor(second, monitor, max_steps=1)
    assert sorted(tables(read_events(second.log_dir))) == [0]


def test_csv_logger_gets_the_counts_without_failing(tmp_path):
    """A CSVLogger, which cannot show the table, still records the per-dtype counts."""
    logger = CSVLogger(tmp_path)
    fit_with_layer_dtype_monitor(logger, LayerDtypeMonitor(), max_steps=1)
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert float(rows[0]["precision/layers/bfloat16"]) == 3


def test_no_logger_is_a_clear_error():
    """Without a logger the monitor refuses to start, naming itself."""
    with pytest.raises(MisconfigurationException, match="LayerDtypeMonitor"):
        fit_with_layer_dtype_monitor(False, LayerDtypeMonitor(), max_steps=1)


@pytest.mark.parametrize("value", [0, -1, 2.5, None, False])
def test_bad_sampling_interval_is_rejected(value):
    """every_n_steps must be a positive integer, and the error names the argument and the value."""
    with pytest.raises(ValueError, match=rf"`every_n_steps` must be an integer >= 1, got {value!r}"):
        LayerDtypeMonitor(every_n_steps=value)  # type: ignore[arg-type]


def test_monitor_survives_pickling_after_a_run(tmp_path):
    """The monitor pickles before and after training, as ddp_spawn needs."""
    monitor = LayerDtypeMonitor(every_n_steps=5)
    pickle.loads(pickle.dumps(monitor))
    fit_with_layer_dtype_monitor(TensorBoardLogger(tmp_path), monitor, max_steps=1)
    assert pickle.loads(pickle.dumps(monitor)).every_n_steps == 5


def test_lean_exact_table_shows_bf16_parameters_with_their_exact_fp32_masters(tmp_path):
    """lean-exact keeps each master packed, but the table shows what the optimizer steps: an fp32 master."""
    logger = TensorBoardLogger(tmp_path)
    fit_with_layer_dtype_monitor(
        logger, LayerDtypeMonitor(), max_steps=1, plugins=[MixedPrecision("bf16-mixed", opt_level="lean-exact")]
    )
    linear = tables(read_events(logger.log_dir))[0]["encoder.0"]
    assert (linear["parameters"], linear["output"], linear["gradients"]) == (
        "bfloat16 (float32 master)",
        "bfloat16",
        "bfloat16",
    )
