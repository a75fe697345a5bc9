"""FSDPMixedPrecision under Lightning's FSDPStrategy (torch FSDP1), for the Trainer and Fabric, on the CPU (gloo).

Lightning runs its FSDPStrategy on GPUs only; these tests run it on the CPU through the tests'
:class:`~tests.helpers.CPUFSDPStrategy` and :class:`~tests.helpers.CPUFabricFSDPStrategy`, which change only where
FSDP wraps the model. The 2-process runs (``ddp_scripts/fsdp_train.py``) compare each FSDP run with the same run
under DDP. The same scenarios on a GPU, with full checkpoints too, are in ``tests/cuda/test_fsdp.py``.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import FSDPPrecision as FabricFSDPPrecision
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.fabric.strategies import SingleDeviceStrategy
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

from lightning_mp import FSDPMixedPrecision, MixedPrecision
from lightning_mp._compat import TORCH_RELEASE
from lightning_mp.fp8.convert import fp8_unavailable
from lightning_mp.plugin.checkpoint import TORCH_SCALER_KEYS
from tests.ddp_scripts.launch import reports, run
from tests.helpers import (
    FEATURES,
    BatchCostRecorder,
    CPUFabricFSDPStrategy,
    CPUFSDPStrategy,
    ManualRegressor,
    PluginStateAtStart,
    TinyRegressor,
    loader,
    make_trainer,
    read_events,
    scalars,
    texts,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:lightning_mp:UserWarning",
    "ignore:FSDP is switching to use `NO_SHARD`",
    "ignore:Please use DTensor instead:FutureWarning",
    "ignore:You're resuming from a checkpoint that ended before the epoch ended",
    "ignore:A FSDP `auto_wrap_policy` is set, but the model is already wrapped",
)

FP32 = torch.float32
FSDP_TRAIN_SCRIPT = Path(__file__).parents[1] / "ddp_scripts" / "fsdp_train.py"


def test_both_fsdp_strategies_accept_the_plugin_and_it_stays_a_mixed_precision() -> None:
    """The Trainer's and Fabric's FSDPStrategy take FSDPMixedPrecision, which is still the package's MixedPrecision."""
    plugin = FSDPMixedPrecision("16-mixed", hysteresis=2)
    assert FSDPStrategy(precision_plugin=plugin).precision_plugin is plugin
    assert FabricFSDPStrategy(precision=plugin).precision is plugin
    assert isinstance(plugin, MixedPrecision | FSDPPrecision | FabricFSDPPrecision)
    assert plugin.settings.scaler.hysteresis == 2
    trainer = make_trainer(plugin, strategy=CPUFSDPStrategy())
    assert trainer.precision_plugin is plugin
    fabric = Fabric(accelerator="cpu", devices=1, strategy=CPUFabricFSDPStrategy(), plugins=[plugin])
    assert fabric.strategy.precision is plugin


def test_the_plain_plugin_is_refused_by_lightning_fsdp_strategy() -> None:
    """A plain MixedPrecision under FSDPStrategy fails at once, with Lightning's TypeError (the docs say why)."""
    with pytest.raises(TypeError, match="FSDPPrecision"):
        make_trainer(MixedPrecision("16-mixed"), strategy=CPUFSDPStrategy())
    with pytest.raises(TypeError, match="FSDPPrecision"):
        FabricFSDPStrategy(precision=MixedPrecision("16-mixed"))


@pytest.mark.parametrize(
    ("precision", "opt_level", "param_dtype", "reduce_dtype"),
    [
        ("32-true", "O1", FP32, FP32),
        ("16-mixed", "O1", FP32, FP32),
        ("bf16-mixed", "O1", FP32, FP32),
        ("16-mixed", "O2", torch.float16, torch.float16),
        ("bf16-mixed", "O2", torch.bfloat16, torch.bfloat16),
    ],
)
def test_the_opt_level_maps_onto_fsdp_mixed_precision(
    precision: str, opt_level: str, param_dtype: torch.dtype, reduce_dtype: torch.dtype
) -> None:
    """O1 gathers fp32 weights (autocast casts per op); O2 gathers half copies of the fp32 shards, reduces in half."""
    config = FSDPMixedPrecision(precision, opt_level=opt_level).mixed_precision_config
    assert (config.param_dtype, config.reduce_dtype, config.buffer_dtype) == (param_dtype, reduce_dtype, FP32)
    # The Trainer's batch (targets too) goes through FSDP's root forward: it must not be rounded to half.
    assert not config.cast_forward_inputs
    assert not config.cast_root_forward_inputs or param_dtype == FP32


def test_auto_precision_has_no_fsdp_policy_before_setup() -> None:
    """precision='auto' is resolved when the strategy sets the model up; asking FSDP's policy earlier says so."""
    with pytest.raises(RuntimeError, match="precision='auto'"):
        _ = FSDPMixedPrecision("auto").mixed_precision_config


@pytest.mark.parametrize("opt_level", ["O3", "lean", "lean-kahan"])
def test_opt_levels_without_fp32_masters_are_refused_with_the_alternative(opt_level: str) -> None:
    """O3, lean and lean-kahan keep half weights that FSDP cannot shard as masters: refused, naming O2."""
    with pytest.raises(ValueError, match=rf"opt_level={opt_level!r}.*opt_level='O2'"):
        FSDPMixedPrecision("bf16-mixed", opt_level=opt_level)


@pytest.mark.skipif(fp8_unavailable() is not None, reason="the FP8 mode needs torchao at its floor")
def test_fp8_is_refused_under_fsdp1_naming_fsdp2() -> None:
    """torchao's float8 training shards with FSDP2 only: FSDPMixedPrecision(fp8=...) is refused with the way there."""
    with pytest.raises(ValueError, match=r"FSDPMixedPrecision\(fp8='tensorwise'\).*ModelParallelStrategy"):
        FSDPMixedPrecision("bf16-mixed", fp8="tensorwise")


def test_modules_are_created_in_fp32_for_fsdp_to_shard() -> None:
    """The strategy's init contexts create fp32 weights: FSDP's shards of them are the master weights."""
    plugin = FSDPMixedPrecision("bf16-mixed", opt_level="O2")
    with plugin.module_init_context(), plugin.tensor_init_context():
        assert nn.Linear(2, 2).weight.dtype == FP32


def _record_weight_dtype(seen: set[torch.dtype], module: nn.Module, args: Any) -> None:
    seen.add(module.weight.dtype)


class DtypeRecordingRegressor(TinyRegressor):
    """The tiny regressor, recording the dtype of the weight each layer computes with (inside FSDP's gather)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.weight_dtypes: dict[str, set[torch.dtype]] = {"first": set(), "second": set()}
        for name, seen in self.weight_dtypes.items():
            self.get_submodule(name).register_forward_pre_hook(functools.partial(_record_weight_dtype, seen))

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.training_step(batch, batch_idx)


def test_lean_exact_under_fsdp_is_o2_bit_for_bit(single_process_group: None) -> None:
    """lean-exact under FSDPStrategy: FSDP's fp32 shards are its exact masters, gathered in bf16 as at O2; with
    clipping and a planted inf, every weight and the counters are O2's under FSDP, bit for bit."""
    results = {}
    for opt_level in ("O2", "lean-exact"):
        torch.manual_seed(0)
        plugin = FSDPMixedPrecision("bf16-mixed", opt_level=opt_level)
        model = DtypeRecordingRegressor(inject_at=(2,))
        make_trainer(plugin, strategy=CPUFSDPStrategy(), gradient_clip_val=1.0).fit(model, loader())
        assert plugin.mixed_precision_config.param_dtype == torch.bfloat16
        assert model.weight_dtypes == {"first": {torch.bfloat16}, "second": {torch.bfloat16}}
        results[opt_level] = (plugin.stats, [p.detach().clone() for p in model.parameters()])
    (o2_stats, o2_weights), (exact_stats, exact_weights) = results["O2"], results["lean-exact"]
    assert exact_stats == o2_stats and exact_stats.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(exact_weights, o2_weights, strict=True))


@pytest.mark.parametrize(("precision", "opt_level"), [("16-mixed", "O1"), ("bf16-mixed", "O2")])
def test_trainer_fsdp_trains_skips_and_computes_in_the_mapped_dtype(
    precision: str, opt_level: str, single_process_group: None
) -> None:
    """A real FSDP fit: the planted inf step is skipped, the weights stay finite, O2 computes on FSDP's half weights."""
    plugin = FSDPMixedPrecision(precision, opt_level=opt_level, init_scale=2.0**8)
    model = DtypeRecordingRegressor(inject_at=(2,))
    make_trainer(plugin, strategy=CPUFSDPStrategy(), gradient_clip_val=1.0).fit(model, loader())
    stats = plugin.stats
    assert (stats.optimizer_steps, stats.skipped_steps) == (8, 1)
    param_dtype = plugin.mixed_precision_config.param_dtype
    assert model.weight_dtypes == {"first": {param_dtype}, "second": {param_dtype}}
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


def test_keep_fp32_under_o1_runs_the_module_in_fp32(single_process_group: None) -> None:
    """Under O1 FSDP gathers fp32 weights, and a keep_fp32 module computes in fp32 while the others autocast."""
    plugin = FSDPMixedPrecision("bf16-mixed", keep_fp32=["second"])
    model = TinyRegressor()
    outputs: dict[str, set[torch.dtype]] = {"first": set(), "second": set()}
    for name, seen in outputs.items():
        model.get_submodule(name).register_forward_hook(lambda _m, _a, output, seen=seen: seen.add(output.dtype))
    make_trainer(plugin, strategy=CPUFSDPStrategy(), max_steps=2).fit(model, loader())
    assert outputs == {"first": {torch.bfloat16}, "second": {FP32}}


def test_keep_fp32_under_o2_computes_on_fp32_weights_in_their_own_unit(single_process_group: None) -> None:
    """Under O2 a keep_fp32 module becomes an fp32 FSDP unit (plugin.auto_wrap_policy); the rest gathers in half."""
    plugin = FSDPMixedPrecision("bf16-mixed", opt_level="O2", keep_fp32=["second"])
    model = DtypeRecordingRegressor(inject_at=(2,))
    strategy = CPUFSDPStrategy(auto_wrap_policy=plugin.auto_wrap_policy({nn.Linear}))
    trainer = make_trainer(plugin, strategy=strategy)
    trainer.fit(model, loader())
    assert model.weight_dtypes == {"first": {torch.bfloat16}, "second": {FP32}}
    assert (plugin.stats.optimizer_steps, plugin.stats.skipped_steps) == (8, 1)
    # A later stage finds the fp32 unit the fit made in the module's place.
    trainer.validate(model, loader(), verbose=False)


def test_fabric_keep_fp32_under_o2_computes_on_fp32_weights_in_their_own_unit(single_process_group: None) -> None:
    """Under Fabric too, plugin.auto_wrap_policy makes a keep_fp32 module an fp32 unit; without it, it is refused."""
    for policy, refused in ((True, False), (False, True)):
        plugin = FSDPMixedPrecision("bf16-mixed", opt_level="O2", keep_fp32=["second"])
        strategy = CPUFabricFSDPStrategy(auto_wrap_policy=plugin.auto_wrap_policy({nn.Linear}) if policy else None)
        fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, plugins=[plugin])
        fabric.launch()
        network = DtypeRecordingRegressor()
        model = fabric.setup_module(network)
        x, _ = next(iter(loader()))
        if refused:
            with pytest.raises(ValueError, match=r"\['second'\] are not FSDP units"):
                model(x)
        else:
            model(x)
            assert network.weight_dtypes == {"first": {torch.bfloat16}, "second": {FP32}}
        plugin.teardown()


def test_keep_fp32_under_o2_without_its_own_unit_is_refused(single_process_group: None) -> None:
    """Under O2 a keep_fp32 module that FSDP would gather in half is refused, naming it and the policy to pass."""
    plugin = FSDPMixedPrecision("bf16-mixed", opt_level="O2", keep_fp32=["second"])
    with pytest.raises(ValueError, match=r"\['second'\] are not FSDP units.*plugin.auto_wrap_policy"):
        make_trainer(plugin, strategy=CPUFSDPStrategy()).fit(TinyRegressor(), loader())


def test_a_mixed_precision_given_to_the_strategy_is_flagged(single_process_group: None) -> None:
    """FSDPStrategy(mixed_precision=...) replaces the plugin's policy: the user is warned that it does."""
    strategy = CPUFSDPStrategy(mixed_precision=TorchMixedPrecision(param_dtype=torch.bfloat16))
    with pytest.warns(UserWarning, match=r"FSDPStrategy\(mixed_precision=.*replaces the policy"):
        make_trainer(FSDPMixedPrecision("bf16-mixed"), strategy=strategy, max_steps=1).fit(TinyRegressor(), loader())


def test_the_fsdp_plugin_under_another_strategy_is_refused() -> None:
    """FSDPMixedPrecision under DDP or one device is refused at setup, pointing to MixedPrecision (O2 needs FSDP)."""
    with pytest.raises(ValueError, match=r"strategy is SingleDeviceStrategy.*Pass MixedPrecision"):
        make_trainer(FSDPMixedPrecision("bf16-mixed", opt_level="O2")).fit(TinyRegressor(), loader())


@pytest.mark.parametrize(("strategy", "opt_level"), [("auto", "O2"), ("auto", "O1"), ("ddp", "O2")])
def test_fabric_refuses_the_fsdp_plugin_under_another_strategy_at_the_first_forward(
    single_process_group: None, strategy: str, opt_level: str
) -> None:
    """Under Fabric, FSDPMixedPrecision with a strategy that is not FSDP's is refused before O2 could run as O1."""
    plugin = FSDPMixedPrecision("bf16-mixed", opt_level=opt_level)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, plugins=[plugin])
    fabric.launch()
    model = fabric.setup_module(TinyRegressor())
    x, _ = next(iter(loader()))
    with pytest.raises(ValueError, match=r"did not wrap the model \(TinyRegressor\) in FullyShardedDataParallel.*Pass"):
        model(x)


@pytest.mark.slow
@pytest.mark.parametrize("compiled", ["before setup", "after setup"])
def test_fabric_refuses_the_fsdp_plugin_on_a_compiled_model_under_another_strategy(
    single_process_group: None, compiled: str
) -> None:
    """A torch.compile'd LightningModule under a strategy that is not FSDP's is refused at its first forward by name,
    as the plain module is, whether it was compiled before or after fabric.setup."""
    plugin = FSDPMixedPrecision("bf16-mixed", opt_level="O2")
    fabric = Fabric(accelerator="cpu", devices=1, strategy=SingleDeviceStrategy(torch.device("cpu")), plugins=[plugin])
    fabric.launch()
    if compiled == "before setup":
        model = fabric.setup_module(torch.compile(TinyRegressor(), backend="eager"))
    else:
        model = torch.compile(fabric.setup_module(TinyRegressor()), backend="eager")
    x, _ = next(iter(loader()))
    with pytest.raises(ValueError, match=r"did not wrap the model \(TinyRegressor\) in FullyShardedDataParallel.*Pass"):
        model(x)


@pytest.mark.slow
def test_fabric_fsdp_accepts_the_plugin_on_a_compiled_model_without_a_hook_warning(single_process_group: None) -> None:
    """Under Fabric's FSDPStrategy a compiled model passes the first forward's check, and torch warns of no hooks."""
    plugin = FSDPMixedPrecision("bf16-mixed", opt_level="O2")
    fabric = Fabric(accelerator="cpu", devices=1, strategy=CPUFabricFSDPStrategy(), plugins=[plugin])
    fabric.launch()
    model = fabric.setup_module(torch.compile(nn.Sequential(nn.Linear(FEATURES, 1)), backend="eager"))
    x, _ = next(iter(loader()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x)
    assert not [warning for warning in caught if "global hooks" in str(warning.message)]


@pytest.mark.parametrize(
    ("precision", "opt_level"), [("16-mixed", "O1"), ("bf16-mixed", "O1"), ("16-mixed", "O2"), ("bf16-mixed", "O2")]
)
def test_trainer_fsdp_manual_optimization_trains_like_the_plain_plugin(
    precision: str, opt_level: str, single_process_group: None
) -> None:
    """Manual optimization under FSDP (manual_backward, clip_gradients, opt.step()) skips the planted inf step and
    follows the same run under the plain plugin without FSDP: same scales and skips, losses within 1e-3."""
    runs = []
    for plugin, strategy in (
        (FSDPMixedPrecision(precision, opt_level=opt_level, init_scale=2.0**8), CPUFSDPStrategy()),
        (MixedPrecision(precision, opt_level=opt_level, init_scale=2.0**8), "auto"),
    ):
        L.seed_everything(0, verbose=False)
        model = ManualRegressor(inject_at=(2,))
        # The same batches in the same order: no DistributedSampler under FSDP.
        trainer = make_trainer(plugin, strategy=strategy, use_distributed_sampler=False)
        trainer.fit(model, loader())
        assert (plugin.stats.optimizer_steps, plugin.stats.skipped_steps) == (8, 1)
        assert all(torch.isfinite(parameter).all() for parameter in model.parameters())
        assert "training_step" not in vars(trainer.strategy)  # the strategy's own step is back after the fit
        runs.append(model)
    fsdp, plain = runs
    assert [skipped for _, skipped in fsdp.steps].index(True) == 2
    assert fsdp.steps == plain.steps
    torch.testing.assert_close(fsdp.losses, plain.losses, rtol=0.0, atol=1e-3)


@pytest.mark.slow
@pytest.mark.filterwarnings(
    "ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available",
    "ignore:CUDA is not available or torch_xla is imported. Disabling autocast",
)
@pytest.mark.skipif(
    TORCH_RELEASE < (2, 12),
    reason="Lightning's own FSDPPrecision, the baseline, fails in backward on the CPU before torch 2.12"
    " (RuntimeError: Found dtype Half but expected Float)",
)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_host_syncs_per_step_are_no_more_than_lightnings_fsdp_precision(
    precision: str, optimizer: str, single_process_group: None
) -> None:
    """A steady FSDP step syncs the host no more often than under Lightning's own FSDPPrecision at the same precision.

    On the CPU Lightning's ``16-mixed`` builds torch's ShardedGradScaler disabled (it scales on CUDA only), so it
    reads no skip flag; an enabled one reads it once per step, as the plugin does: fp16 is allowed that one sync.
    (Lightning's plugin also leaves autocast out on the CPU, which syncs nothing either way.)
    """
    syncs: dict[str, list[int]] = {}
    for name, plugin in (("ours", FSDPMixedPrecision(precision)), ("lightning", FSDPPrecision(precision))):
        recorder = BatchCostRecorder()
        callbacks = [recorder.opener(), recorder.closer()]
        make_trainer(plugin, strategy=CPUFSDPStrategy(), callbacks=callbacks).fit(
            TinyRegressor(optimizer=optimizer), loader()
        )
        # The first steps create the optimizer states (SGD's momentum decides its first step on the host).
        syncs[name] = [counts.syncs for counts in recorder.per_batch[3:]]
        if dist.is_initialized():
            dist.destroy_process_group()
    allowed = 1 if precision == "16-mixed" else 0
    assert max(syncs["ours"]) <= min(syncs["lightning"]) + allowed, syncs


def test_trainer_resumes_the_plugin_state_from_a_sharded_fsdp_checkpoint(
    tmp_path: Path, single_process_group: None
) -> None:
    """The scale, trackers and counters saved in FSDPStrategy's sharded checkpoint come back exactly on resume."""
    plugin = FSDPMixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=2, hysteresis=2)
    first = make_trainer(plugin, strategy=CPUFSDPStrategy(state_dict_type="sharded"), max_steps=6)
    first.fit(TinyRegressor(inject_at=(2, 3)), loader())
    first.save_checkpoint(tmp_path / "sharded")
    assert (tmp_path / "sharded").is_dir()
    recorder = PluginStateAtStart()
    resumed = FSDPMixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=2, hysteresis=2)
    strategy = CPUFSDPStrategy(state_dict_type="sharded")
    make_trainer(resumed, strategy=strategy, max_steps=7, callbacks=[recorder]).fit(
        TinyRegressor(), loader(), ckpt_path=tmp_path / "sharded"
    )
    assert recorder.state["scaler"] == plugin.state_dict()["scaler"]
    assert recorder.state["scaler"]["counters"]["skipped_steps"] == 2


def test_a_run_moved_between_one_device_and_fsdp_resumes_its_scaler_state(
    tmp_path: Path, single_process_group: None
) -> None:
    """MixedPrecision's checkpoint resumes under FSDPMixedPrecision and back, at the scale and counts it reached."""
    plugin = MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=2)
    first = make_trainer(plugin, max_steps=5)
    first.fit(TinyRegressor(inject_at=(1,)), loader())
    first.save_checkpoint(tmp_path / "single.ckpt")
    recorder = PluginStateAtStart()
    fsdp_plugin = FSDPMixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=2)
    fsdp = make_trainer(fsdp_plugin, strategy=CPUFSDPStrategy(), max_steps=6, callbacks=[recorder])
    fsdp.fit(TinyRegressor(), loader(), ckpt_path=tmp_path / "single.ckpt")
    assert recorder.state["scaler"] == plugin.state_dict()["scaler"]
    fsdp.save_checkpoint(tmp_path / "fsdp.ckpt")
    checkpoint = torch.load(tmp_path / "fsdp.ckpt", weights_only=False)
    # Lightning's own FSDPPrecision reads torch's five GradScaler keys under its own name.
    assert checkpoint["FSDPPrecision"] == {key: checkpoint["FSDPMixedPrecision"][key] for key in TORCH_SCALER_KEYS}
    back = PluginStateAtStart()
    make_trainer(MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=2), max_steps=7, callbacks=[back]).fit(
        TinyRegressor(), loader(), ckpt_path=tmp_path / "fsdp.ckpt"
    )
    assert back.state["scaler"] == fsdp_plugin.state_dict()["scaler"]


# ------------------------------------------------------------------------------------------------ 2 processes


def _fsdp_and_ddp(
    tmp_path: Path, front: str, precision: str, opt_level: str, *options: str
) -> tuple[list[dict], list[dict]]:
    """The reports of the same 2-process run under FSDP (sharded checkpoint) and under DDP."""
    runs = []
    for strategy in ("fsdp", "ddp"):
        out = tmp_path / strategy
        out.mkdir()
        arguments = ["--front", front, "--strategy", strategy, "--out", str(out), "--precision", precision]
        arguments += ["--opt-level", opt_level, "--inject-rank", "1", "--inject-at", "2,5", "--clip", "norm"]
        arguments += ["--state-dict-type", "sharded", *options]
        run(arguments, timeout=60, script=FSDP_TRAIN_SCRIPT)
        runs.append(reports(out))
    return runs[0], runs[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("front", "precision", "opt_level"),
    [
        ("trainer", "16-mixed", "O1"),
        ("trainer", "bf16-mixed", "O2"),
        ("fabric", "bf16-mixed", "O1"),
        ("fabric", "16-mixed", "O2"),
    ],
)
def test_fsdp_on_two_processes_matches_ddp(tmp_path: Path, front: str, precision: str, opt_level: str) -> None:
    """Under FSDP an inf on one rank's shard is skipped by both ranks, as under DDP: same skips, scales and losses."""
    fsdp, ddp = _fsdp_and_ddp(tmp_path, front, precision, opt_level, *(["--telemetry"] if front == "trainer" else []))
    _assert_skips_like_ddp_and_resumes(fsdp, ddp)
    if front == "trainer":
        _assert_same_telemetry(tmp_path / "fsdp", tmp_path / "ddp", skipped=(2, 5), opt_level=opt_level)


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "opt_level"), [("16-mixed", "O1"), ("bf16-mixed", "O2")])
def test_fsdp_peak_memory_per_rank_is_at_most_0_6_of_ddps(tmp_path: Path, precision: str, opt_level: str) -> None:
    """Each rank's peak tensor bytes in a training step under FSDP are at most 0.6x those of the same run under DDP
    (a wider model with Adam, each linear layer an FSDP unit; ``tests.helpers.peak_step_bytes``)."""
    arguments = ["--memory", "--out", str(tmp_path), "--precision", precision, "--opt-level", opt_level]
    run(arguments, timeout=60, script=FSDP_TRAIN_SCRIPT)
    for rank in reports(tmp_path):
        memory = rank["memory"]
        assert memory["fsdp"] <= 0.6 * memory["ddp"], memory


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "opt_level"), [("16-mixed", "O1"), ("bf16-mixed", "O2")])
def test_fsdp_manual_optimization_on_two_processes_matches_ddp(tmp_path: Path, precision: str, opt_level: str) -> None:
    """Manual optimization under FSDP (manual_backward, clip_gradients by norm, opt.step()) skips an inf on one rank's
    shard on both ranks, as under DDP: same skips and scales, losses within 1e-3, the state resumed."""
    fsdp, ddp = _fsdp_and_ddp(tmp_path, "trainer", precision, opt_level, "--manual")
    _assert_skips_like_ddp_and_resumes(fsdp, ddp)


def _assert_skips_like_ddp_and_resumes(fsdp: list[dict[str, Any]], ddp: list[dict[str, Any]]) -> None:
    """Both FSDP ranks skip DDP's steps (the planted infs at 2 and 5) with its scales and counters, their losses are
    within 1e-3 of DDP's, and the plugin's state came back whole on every rank from the sharded checkpoint."""
    assert fsdp[0]["steps"] == fsdp[1]["steps"] == ddp[0]["steps"]
    assert [index for index, (_, skipped) in enumerate(fsdp[0]["steps"]) if skipped] == [2, 5]
    assert fsdp[0]["stats"] == fsdp[1]["stats"] == ddp[0]["stats"]
    for fsdp_rank, ddp_rank in zip(fsdp, ddp, strict=True):
        torch.testing.assert_close(fsdp_rank["losses"], ddp_rank["losses"], rtol=0.0, atol=1e-3)
    assert fsdp[0]["resumed_stats"] == fsdp[1]["resumed_stats"] == fsdp[0]["stats"]


def _gradient_column(table: str) -> list[str]:
    """The last column (gradients) of a layer dtype table's rows."""
    return [row.rstrip(" |").rsplit("| ", 1)[-1] for row in table.splitlines()[2:]]


def _without_gradient_column(table: str) -> list[str]:
    """A layer dtype table's rows without their last column (gradients)."""
    return [row.rstrip(" |").rsplit("| ", 1)[0] for row in table.splitlines()]


def _assert_same_telemetry(fsdp_out: Path, ddp_out: Path, skipped: tuple[int, ...], opt_level: str) -> None:
    """The monitors report the whole gradients under FSDP, as under DDP: scalars, histogram, bad parameters, dtypes."""
    fsdp, ddp = read_events(fsdp_out / "tb" / "version_0"), read_events(ddp_out / "tb" / "version_0")
    for tag in (
        "precision/loss_scale",
        "precision/skipped_steps_total",
        "precision_sentinel/total_grad_underflow_share",
    ):
        assert scalars(fsdp, tag) == scalars(ddp, tag), tag
    assert max(scalars(fsdp, "precision_sentinel/total_grad_underflow_share").values()) > 0
    fsdp_tables, ddp_tables = texts(fsdp, "precision/layer_dtypes"), texts(ddp, "precision/layer_dtypes")
    if opt_level == "O2":
        # DDP's O2 reduces the half weights' gradients; FSDP's O2 hands its fp32 shards (the masters) fp32 gradients.
        assert {step: _without_gradient_column(t) for step, t in fsdp_tables.items()} == {
            step: _without_gradient_column(t) for step, t in ddp_tables.items()
        }
        assert {dtype for table in fsdp_tables.values() for dtype in _gradient_column(table)} == {"float32"}
    else:
        assert fsdp_tables == ddp_tables
    for tag in ("precision/grad_norm", "precision/grad_zero_fraction", "precision/grad_headroom_log2"):
        # Under DDP rank 1's planted inf never reaches rank 0, which logs its own finite gradients on those steps.
        expected = {step: value for step, value in scalars(ddp, tag).items() if step not in skipped}
        assert scalars(fsdp, tag).keys() == expected.keys(), tag
        torch.testing.assert_close(scalars(fsdp, tag), expected, rtol=1e-5, atol=0.0)
    histograms = [
        {event.step: list(event.histogram_value.bucket) for event in events.Histograms("precision/grad_log2_magnitude")}
        for events in (fsdp, ddp)
    ]
    assert histograms[0] == {step: buckets for step, buckets in histograms[1].items() if step not in skipped}
    # The non-finite parameter is named as the model declares it, with its full shape, not its shard's.
    for step in skipped:
        assert "| `first.weight` | [16, 8] |" in texts(fsdp, "precision/overflow")[step]
