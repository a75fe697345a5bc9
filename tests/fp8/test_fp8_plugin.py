"""The FP8 mode under the Trainer and Fabric: training, setup line, teardown to plain layers, checkpoints, fallback."""

from __future__ import annotations

import io
import logging
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mp.fp8.convert import fp8_unavailable

if fp8_unavailable() is not None:  # torchao below its torch floor may fail to import with other errors than ImportError
    pytest.skip(f"the FP8 mode {fp8_unavailable()}", allow_module_level=True)
pytest.importorskip("torchao")

from lightning_mp import MixedPrecision
from lightning_mp.fp8 import FP8Settings, fp8_layer_names
from lightning_mp.fp8.convert import fallback_layer, is_fp8_linear
from tests.fp8.plugin_models import TinyMlp, fabric_setup, mlp, regression_loader
from tests.helpers import fit, make_trainer

FP8_LAYERS = ["net.2", "net.4"]
"""The MLP's layers that run FP8 by default: the first (net.0) and the last (net.6) stay bf16."""


class LayerTypes(L.Callback):
    """Records, at every training batch, which layers compute in FP8."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        self.seen.append(fp8_layer_names(pl_module))


def fit_bf16_mixed(
    model: TinyMlp, fp8: Any = "tensorwise", steps: int = 6, **kwargs: Any
) -> tuple[L.Trainer, MixedPrecision]:
    """Fit ``model`` on :func:`regression_loader` for ``steps`` steps with a bf16-mixed MixedPrecision plugin of
    ``fp8`` and ``kwargs``' ``opt_level`` (O1 when absent); the other ``kwargs`` go to :func:`tests.helpers.fit`.
    The Trainer and the plugin."""
    plugin = MixedPrecision("bf16-mixed", opt_level=kwargs.pop("opt_level", "O1"), fp8=fp8)
    return fit(model, plugin, regression_loader(), max_steps=steps, **kwargs), plugin


def _mean_last(losses: list[float], n: int) -> float:
    return sum(losses[-n:]) / n


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fp8_layers_run_during_fit_and_plain_linears_with_the_same_parameters_come_back(opt_level):
    """During fit the middle layers are torchao FP8 linears; after it every layer is a plain nn.Linear with the same
    weight and bias objects, and the weights trained."""
    model = TinyMlp()
    parameters = [id(parameter) for parameter in model.parameters()]
    before = model.net[2].weight.detach().clone()
    types = LayerTypes()
    fit_bf16_mixed(model, opt_level=opt_level, callbacks=[types])
    assert types.seen and all(seen == FP8_LAYERS for seen in types.seen)
    assert all(type(layer) is nn.Linear for layer in model.net if isinstance(layer, nn.Linear))
    assert [id(parameter) for parameter in model.parameters()] == parameters
    assert all(parameter.dtype == torch.float32 for parameter in model.parameters())
    assert not torch.equal(model.net[2].weight, before)


def test_after_fit_the_model_saves_and_loads_without_torchao_objects():
    """torch.save of the whole model after an FP8 fit pickles no torchao object, so it loads without torchao."""
    model = TinyMlp()
    fit_bf16_mixed(model, steps=3)
    buffer = io.BytesIO()
    torch.save(model.net, buffer)
    assert b"torchao" not in buffer.getvalue() and b"lightning_mp" not in buffer.getvalue()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(torch.ones(2, 16)), model.net(torch.ones(2, 16)))


def test_setup_logs_one_line_with_the_layers_and_parameters_in_fp8(caplog):
    """One line at setup says how many layers and parameters run FP8 and which stay bf16 and why."""
    with caplog.at_level(logging.INFO):
        fit_bf16_mixed(TinyMlp(), fp8=FP8Settings(recipe="rowwise"), steps=1)
    lines = [record.getMessage() for record in caplog.records if "FP8 (" in record.getMessage()]
    assert lines == [
        "lightning_mp: FP8 (rowwise): 2 of 4 linear layers, 8.3K of 9.7K linear parameters; bf16: net.0 (first"
        " linear), net.6 (last linear)"
    ]


def test_keep_fp32_layers_stay_out_of_fp8():
    """A layer kept in fp32 by keep_fp32 is not converted to FP8."""
    types = LayerTypes()
    plugin = MixedPrecision("bf16-mixed", fp8="tensorwise", keep_fp32=["net.2"])
    make_trainer(plugin, max_steps=2, callbacks=[types]).fit(TinyMlp(), regression_loader())
    assert types.seen[-1] == ["net.4"]


@pytest.mark.parametrize(
    ("recipe", "steps"),
    [
        ("tensorwise", 60),
        pytest.param("tensorwise", 300, marks=pytest.mark.slow),
        pytest.param("rowwise", 300, marks=pytest.mark.slow),
        pytest.param("rowwise_with_gw_hp", 300, marks=pytest.mark.slow),
    ],
)
def test_each_recipe_trains_within_one_percent_of_the_bf16_loss(recipe, steps):
    """Trained in FP8 (emulated on the CPU), the MLP learns and its loss over the last steps is within 1% of bf16's.

    The targets carry noise, as text carries entropy: the loss a model can reach has a floor, as an LM's has.
    """
    window = steps // 3
    reference = TinyMlp()
    fit_bf16_mixed(reference, fp8=None, steps=steps)
    model = TinyMlp()
    fit_bf16_mixed(model, fp8=recipe, steps=steps)
    assert _mean_last(model.losses, window) < 0.95 * sum(model.losses[:10]) / 10
    assert _mean_last(model.losses, window) == pytest.approx(_mean_last(reference.losses, window), rel=0.01)


class FallBackAt(L.Callback):
    """Returns ``name`` to bf16 at step ``step``, recording the weight and its Adam state before and after."""

    def __init__(self, step: int, name: str = "net.2") -> None:
        self.step, self.name = step, name
        self.before: dict[str, Any] = {}
        self.after: dict[str, Any] = {}
        self.fell: bool | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step != self.step:
            return
        self.before = self._snapshot(trainer, pl_module)
        self.fell = fallback_layer(pl_module, self.name, "underflow share 0.4 > 0.1 for 3 logging steps")
        self.after = self._snapshot(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.at_end = self._snapshot(trainer, pl_module)

    def _snapshot(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        weight = pl_module.get_submodule(self.name).weight
        state = trainer.optimizers[0].state[weight]
        return {
            "weight": weight,
            "exp_avg": state["exp_avg"],
            "step": float(state["step"]),
            "fp8": fp8_layer_names(pl_module),
        }


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fallback_returns_one_layer_to_bf16_with_the_same_weight_and_optimizer_state(opt_level):
    """A layer that falls back is a plain Linear for the rest of the run, holding the same weight, whose optimizer
    state is the same objects and keeps stepping; the other FP8 layer stays FP8; after fit the model holds its own
    fp32 parameters."""
    fall_back = FallBackAt(step=3)
    types = LayerTypes()
    model = TinyMlp()
    weight = model.net[2].weight
    _trainer, plugin = fit_bf16_mixed(model, steps=6, callbacks=[fall_back, types], opt_level=opt_level)
    assert model.net[2].weight is weight and weight.dtype == torch.float32
    assert fall_back.fell is True
    assert fall_back.before["fp8"] == FP8_LAYERS and fall_back.after["fp8"] == ["net.4"]
    assert fall_back.after["weight"] is fall_back.before["weight"] is fall_back.at_end["weight"]
    assert fall_back.after["exp_avg"] is fall_back.before["exp_avg"] is fall_back.at_end["exp_avg"]
    assert fall_back.at_end["step"] == 6 and fall_back.before["step"] == 3
    assert types.seen[4:] == [["net.4"], ["net.4"]]
    assert plugin.fp8_fell_back == {"net.2": "underflow share 0.4 > 0.1 for 3 logging steps"}


def test_fallback_of_a_layer_not_in_fp8_names_the_fp8_layers():
    """Asking to return a layer that is not FP8 names the layers that are."""
    plugin = MixedPrecision("bf16-mixed", fp8="tensorwise")
    model = TinyMlp()
    make_trainer(plugin, max_steps=1).fit(model, regression_loader())
    with pytest.raises(RuntimeError, match="needs a running FP8 model"):
        plugin.fallback_layer(model, "net.0", "why")
    with pytest.raises(RuntimeError, match="needs an FP8 run"):
        MixedPrecision("bf16-mixed").fallback_layer(model, "net.2", "why")


def test_checkpoints_go_from_fp8_to_bf16_and_back_and_keep_fallbacks(tmp_path):
    """A run saved in FP8 resumes in FP8, also into a bf16 run, and a bf16 run's checkpoint resumes in FP8; a layer
    that fell back stays bf16 after the resume."""
    fp8_run = TinyMlp()
    trainer, _ = fit_bf16_mixed(fp8_run, steps=4, callbacks=[FallBackAt(step=2)], enable_checkpointing=False)
    first = tmp_path / "fp8.ckpt"
    trainer.save_checkpoint(first)
    saved = torch.load(first, weights_only=False)
    assert saved["MixedPrecision"]["fp8"] == {
        "recipe": "tensorwise",
        "fell_back": {"net.2": "underflow share 0.4 > 0.1 for 3 logging steps"},
    }
    assert not any("torchao" in type(value).__module__ for value in saved["state_dict"].values())

    resumed_fp8 = LayerTypes()
    fit_bf16_mixed(TinyMlp(seed=1), steps=6, callbacks=[resumed_fp8], ckpt_path=first)
    assert resumed_fp8.seen and all(seen == ["net.4"] for seen in resumed_fp8.seen)

    in_bf16 = LayerTypes()
    bf16_run = TinyMlp(seed=1)
    trainer, _ = fit_bf16_mixed(bf16_run, fp8=None, steps=6, callbacks=[in_bf16], ckpt_path=first)
    assert in_bf16.seen == [[], []]
    second = tmp_path / "bf16.ckpt"
    trainer.save_checkpoint(second)
    assert "fp8" not in torch.load(second, weights_only=False)["MixedPrecision"]

    back_in_fp8 = LayerTypes()
    final = TinyMlp(seed=2)
    fit_bf16_mixed(final, steps=8, callbacks=[back_in_fp8], ckpt_path=second)
    assert back_in_fp8.seen == [FP8_LAYERS, FP8_LAYERS]
    assert all(type(layer) is nn.Linear for layer in final.net if isinstance(layer, nn.Linear))


def test_fabric_trains_in_fp8_and_teardown_restores_plain_layers():
    """Under Fabric the optimizer built before setup steps the FP8 layers' weights; teardown gives plain layers."""
    torch.manual_seed(0)
    model = mlp()
    fabric, plugin, wrapped, optimizer = fabric_setup(model, fp8="rowwise")
    assert [is_fp8_linear(layer) for layer in model] == [False, False, True, False, True, False, False]
    assert plugin.fp8_layers == ["2", "4"]
    before = model[2].weight.detach().clone()
    x, y = regression_loader().dataset.tensors
    for step in range(3):
        loss = nn.functional.mse_loss(wrapped(x[step * 32 : (step + 1) * 32]).float(), y[step * 32 : (step + 1) * 32])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert not torch.equal(model[2].weight, before)
    plugin.teardown()
    assert all(type(layer) is nn.Linear for layer in model if isinstance(layer, nn.Linear))


@pytest.mark.slow
def test_fabric_fp8_under_torch_compile_matches_eager():
    """A model compiled after fabric.setup traces torchao's FP8 layers and trains as the eager FP8 model does."""
    x, y = regression_loader().dataset.tensors

    def train(compile_model: bool) -> list[float]:
        torch.manual_seed(0)
        model = mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("bf16-mixed", fp8="tensorwise")])
        wrapped, optimizer = fabric.setup(model, optimizer)
        forward = torch.compile(wrapped, backend="aot_eager") if compile_model else wrapped
        losses = []
        for step in range(3):
            batch = slice(step * 32, (step + 1) * 32)
            loss = nn.functional.mse_loss(forward(x[batch]).float(), y[batch])
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    assert train(compile_model=True) == pytest.approx(train(compile_model=False), rel=1e-3)


class FellBack(L.Callback):
    """Records, at the end of fit, which of the MLP's middle linears still run FP8."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.fp8 = [name for name in ("net.2", "net.4") if is_fp8_linear(pl_module.get_submodule(name))]


def test_fp8_settings_fallback_true_makes_the_monitor_fall_back_by_the_settings_thresholds(tmp_path) -> None:
    """FP8Settings(fallback=True, ...) turns the fallback on: an FP8Monitor() given no rule of its own takes the
    settings' thresholds (here an SQNR no cast reaches, after one logging step) and the layers return to bf16."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_mp.fp8.telemetry import FP8Monitor

    settings = FP8Settings(fallback=True, fallback_min_sqnr_db=1000.0, fallback_patience=1)
    monitor, recorded = FP8Monitor(every_n_steps=2, log_heatmaps=False), FellBack()
    plugin = MixedPrecision("bf16-mixed", fp8=settings)
    trainer = make_trainer(
        plugin, max_steps=4, logger=CSVLogger(tmp_path), log_every_n_steps=2, callbacks=[monitor, recorded]
    )
    trainer.fit(TinyMlp(), regression_loader(n=128))
    assert recorded.fp8 == []
    assert set(monitor.fell_back) == {"net.2", "net.4"}
    assert all("SQNR" in reason for reason in monitor.fell_back.values())


def test_without_fallback_in_the_settings_the_monitor_falls_back_nothing(tmp_path) -> None:
    """The default FP8Settings(fallback=False) and an FP8Monitor() without a rule measure, and return no layer."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_mp.fp8.telemetry import FP8Monitor

    monitor, recorded = FP8Monitor(every_n_steps=2, log_heatmaps=False), FellBack()
    trainer = make_trainer(
        MixedPrecision("bf16-mixed", fp8="tensorwise"),
        max_steps=4,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=2,
        callbacks=[monitor, recorded],
    )
    trainer.fit(TinyMlp(), regression_loader(n=128))
    assert recorded.fp8 == ["net.2", "net.4"] and monitor.fell_back == {} and monitor.samples


def test_fp8_settings_fallback_true_without_a_monitor_warns_that_nothing_will_fall_back() -> None:
    """FP8Settings(fallback=True) in a Trainer with no FP8Monitor warns at setup, naming the callback to add."""
    plugin = MixedPrecision("bf16-mixed", fp8=FP8Settings(fallback=True))
    with pytest.warns(UserWarning, match=r"FP8Settings\(fallback=True\) .* has none.* callbacks=\[FP8Monitor\(\)\]"):
        make_trainer(plugin, max_steps=1).fit(TinyMlp(), regression_loader(n=32))


def test_fabric_falls_back_a_layer_of_the_module_fabric_returned():
    """fallback_layer takes the module fabric.setup returned, the only one a Fabric user holds."""
    torch.manual_seed(0)
    model = mlp()
    _, plugin, wrapped, _ = fabric_setup(model)
    assert plugin.fallback_layer(wrapped, "2", "by hand") is True
    assert plugin.fp8_layers == ["4"] and type(model[2]) is nn.Linear
    with pytest.raises(RuntimeError, match="not the model the FP8 mode converted"):
        plugin.fallback_layer(mlp(), "4", "another model")
    plugin.teardown()


def test_a_model_with_no_fp8_layer_warns_naming_the_layers_and_why():
    """fp8 asked for on a model none of whose layers FP8 takes warns, naming them, instead of training silently."""

    class Narrow(TinyMlp):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 24), nn.GELU(), nn.Linear(24, 4))

    with pytest.warns(
        UserWarning, match=r"fp8='tensorwise' was asked for, but no linear layer runs FP8.*net\.2 \(dims"
    ):
        fit_bf16_mixed(Narrow(), steps=1)


def test_the_monitor_says_once_that_it_has_nothing_to_watch(tmp_path):
    """An FP8Monitor in a run without FP8 layers warns at the start instead of logging nothing."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_mp import FP8Monitor

    trainer_kwargs = {"logger": TensorBoardLogger(tmp_path), "callbacks": [FP8Monitor(log_heatmaps=False)]}
    with pytest.warns(UserWarning, match="FP8Monitor has nothing to watch"):
        fit(TinyMlp(), MixedPrecision("bf16-mixed"), regression_loader(), max_steps=1, **trainer_kwargs)


def test_the_setup_line_after_a_resume_says_which_layers_fell_back(tmp_path, caplog):
    """After resuming a run whose layer fell back, a second line says what runs FP8 now (the first was written
    before the checkpoint was applied)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit_bf16_mixed(TinyMlp(), steps=4, callbacks=[FallBackAt(step=2), checkpoints], enable_checkpointing=True)
    with caplog.at_level(logging.INFO):
        fit_bf16_mixed(TinyMlp(), steps=5, ckpt_path=tmp_path / "last.ckpt")
    lines = [record.getMessage() for record in caplog.records if "FP8 (" in record.getMessage()]
    assert lines[-1].startswith("lightning_mp: after the checkpoint's fallbacks: FP8 (tensorwise): 1 of 4")
    assert "net.2 (fell back)" in lines[-1]
