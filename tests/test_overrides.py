"""keep_fp32: matching by type, name and regex; fp32 regions under autocast and O2; custom_fwd under the plugin."""

from __future__ import annotations

import copy
import io
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecision
from lightning_mp.overrides import Fp32Overrides
from tests.helpers import fit, hook_count, make_trainer


class Block(nn.Module):
    """A tiny attention-named block, so that regexes have something to match."""

    def __init__(self) -> None:
        super().__init__()
        self.attn_proj = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x + self.attn_proj(x))


class Classifier(LightningModule):
    """Linear stem, one block, a head; records the output dtype of every submodule on each training forward."""

    def __init__(self, keep_fp32_seen: bool = True) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.block = Block()
        self.head = nn.Linear(16, 4)
        self.output_dtypes: dict[str, torch.dtype] = {}
        for name, module in self.named_modules():
            if name:
                module.register_forward_hook(self._recorder(name))

    def _recorder(self, name: str):
        def record(module: nn.Module, args: tuple, output: Tensor) -> None:
            self.output_dtypes[name] = output.dtype

        return record

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.block(self.stem(x))))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        features, target = batch
        return nn.functional.cross_entropy(self(features).float(), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(16, 8, generator=generator), torch.randint(0, 4, (16,), generator=generator))
        return DataLoader(data, batch_size=8)


@pytest.mark.parametrize(
    ("pattern", "matched"),
    [(nn.LayerNorm, "block.norm"), ("head", "head"), ("re:.*attn.*", "block.attn_proj"), ("block", "block")],
    ids=["type", "name", "regex", "subtree"],
)
def test_keep_fp32_runs_matched_modules_in_fp32_under_cpu_autocast(pattern: object, matched: str) -> None:
    """Modules matched by type, name or regex return fp32 under CPU autocast; unmatched layers stay bf16."""
    model = Classifier()
    assert Fp32Overrides([pattern]).apply(model) == [matched]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 8))
    assert model.output_dtypes[matched] == torch.float32
    assert model.output_dtypes["stem"] == torch.bfloat16
    if matched != "head":
        assert model.output_dtypes["head"] == torch.bfloat16


def test_fp32_region_casts_half_inputs_and_restores_autocast() -> None:
    """A kept module gets fp32 inputs even when fed bf16, and autocast is back on after it, even if it raised."""
    seen: list[tuple[torch.dtype, bool]] = []

    class Probe(nn.Module):
        def forward(self, x: Tensor, fail: bool = False) -> Tensor:
            seen.append((x.dtype, torch.is_autocast_enabled("cpu")))
            if fail:
                raise RuntimeError("boom")
            return x * 2

    probe = Probe()
    Fp32Overrides([Probe]).apply(probe)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert probe(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.float32
        with pytest.raises(RuntimeError, match="boom"):
            probe(torch.ones(2, dtype=torch.bfloat16), fail=True)
        assert torch.is_autocast_enabled("cpu")
    assert seen == [(torch.float32, False), (torch.float32, False)]


def test_unmatched_pattern_warns_naming_it_and_suggests_close_names() -> None:
    """A pattern that matches nothing warns with the pattern and the nearest real names."""
    with pytest.warns(UserWarning, match=r"'blok\.norm' matches no module.*block\.norm"):
        Fp32Overrides(["blok.norm", "head"]).apply(Classifier())


def test_regex_must_match_the_whole_name() -> None:
    """'re:attn' does not match 'block.attn_proj'; 're:.*attn.*' does."""
    model = Classifier()
    with pytest.warns(UserWarning, match="'re:attn' matches no module"):
        assert Fp32Overrides(["re:attn"]).match(model) == []
    assert Fp32Overrides(["re:.*attn.*"]).match(model) == ["block.attn_proj"]


@pytest.mark.parametrize(
    ("patterns", "message"),
    [
        ("head", r"keep_fp32='head' is not allowed: keep_fp32 must be a list"),
        (nn.LayerNorm, r"keep_fp32=<class .*LayerNorm'> is not allowed"),
        ([3], r"keep_fp32 entry 3 is not allowed: each entry must be an nn.Module subclass"),
        ([torch.Tensor], r"keep_fp32 entry <class 'torch.Tensor'> is not allowed"),
        (["re:(unclosed"], r"keep_fp32 entry 're:\(unclosed' is not allowed: '\(unclosed' is not a valid regular"),
    ],
)
def test_bad_patterns_raise_value_error(patterns: object, message: str) -> None:
    """The plugin rejects keep_fp32 entries it cannot match, naming the value and what is allowed."""
    with pytest.raises(ValueError, match=message):
        MixedPrecision("bf16-mixed", keep_fp32=patterns)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("patterns", "example"),
    [("head", "keep_fp32=['head']"), (nn.LayerNorm, "keep_fp32=[LayerNorm]"), (5, "keep_fp32=[nn.LayerNorm")],
)
def test_a_keep_fp32_that_is_not_a_list_suggests_a_valid_list(patterns: object, example: str) -> None:
    """The error for a keep_fp32 that is not a list suggests a list that would be accepted, never keep_fp32=[5]."""
    with pytest.raises(ValueError, match=re.escape(f"for example {example}")):
        MixedPrecision("bf16-mixed", keep_fp32=patterns)  # type: ignore[arg-type]


def test_applying_twice_attaches_hooks_once() -> None:
    """Converting the same model again (fit, then validate) does not stack hooks."""
    model = Classifier()
    overrides = Fp32Overrides(["head"])
    overrides.apply(model)
    overrides.apply(model)
    assert len(model.head._forward_pre_hooks) == 1


def test_hooks_removed_by_their_handles_are_attached_again_once() -> None:
    """After teardown (or the user) removes the fp32 region's hooks, applying again attaches them again, once."""
    model = Classifier()
    own_forward_hooks = len(model.head._forward_hooks)
    overrides = Fp32Overrides(["head"])
    handles: list = []
    overrides.apply(model, handles)
    for handle in handles:
        handle.remove()
    assert not model.head._forward_pre_hooks and len(model.head._forward_hooks) == own_forward_hooks
    overrides.apply(model)
    overrides.apply(model)
    assert len(model.head._forward_pre_hooks) == len(model.head._forward_hooks) - own_forward_hooks == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.head(torch.randn(2, model.head.in_features)).dtype == torch.float32


def test_hooked_model_and_plugin_pickle_and_deepcopy() -> None:
    """A model with fp32 regions, and a plugin with keep_fp32, survive pickle (ddp_spawn) and deepcopy."""
    plugin = pickle.loads(pickle.dumps(MixedPrecision("bf16-mixed", keep_fp32=[nn.LayerNorm, "head", "re:.*"])))
    assert plugin.keep_fp32 == [nn.LayerNorm, "head", "re:.*"]
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    Fp32Overrides(["2"]).apply(model)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert clone(torch.randn(2, 8)).dtype == torch.float32


def test_keep_fp32_under_the_default_o1_plugin() -> None:
    """MixedPrecision('bf16-mixed', keep_fp32=[type, name, regex]) runs those layers in fp32 during training."""
    model = Classifier()
    fit(model, MixedPrecision("bf16-mixed", keep_fp32=[nn.LayerNorm, "head", "re:.*attn.*"]), max_steps=2)
    assert {name: model.output_dtypes[name] for name in ("block.norm", "head", "block.attn_proj", "stem")} == {
        "block.norm": torch.float32,
        "head": torch.float32,
        "block.attn_proj": torch.float32,
        "stem": torch.bfloat16,
    }


def test_keep_fp32_under_o2_keeps_matched_weights_fp32() -> None:
    """Under O2 kept modules compute in fp32 and output fp32, while the rest computes and outputs bf16."""
    model = Classifier()
    fit(model, MixedPrecision("bf16-mixed", opt_level="O2", keep_fp32=["head", "re:block\\.attn.*"]), max_steps=2)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # after fit O2's model holds its fp32 masters
    assert model.output_dtypes["head"] == torch.float32
    assert model.output_dtypes["stem"] == torch.bfloat16


def make_square_function(cast_inputs: torch.dtype | None) -> type[torch.autograd.Function]:
    """y = x * x with a hand-written backward, recording the dtype and autocast state each pass ran in."""

    class Square(torch.autograd.Function):
        seen: ClassVar[dict[str, tuple[torch.dtype, bool]]] = {}

        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu", cast_inputs=cast_inputs)
        def forward(ctx: Any, x: Tensor) -> Tensor:
            Square.seen["forward"] = (x.dtype, torch.is_autocast_enabled("cpu"))
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx: Any, grad: Tensor) -> Tensor:
            (x,) = ctx.saved_tensors
            Square.seen["backward"] = (grad.dtype, torch.is_autocast_enabled("cpu"))
            return 2 * x * grad

    return Square


class CustomFunctionModel(Classifier):
    def __init__(self, function: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.stem(x)
        squared = self.function.apply(hidden)
        self.output_dtypes["custom"] = squared.dtype
        return self.head(squared)


@pytest.mark.parametrize(
    ("cast_inputs", "forward_seen", "backward_seen"),
    [
        (torch.float32, (torch.float32, False), (torch.float32, False)),
        (None, (torch.bfloat16, True), (torch.bfloat16, True)),
    ],
    ids=["cast_inputs_fp32", "no_cast"],
)
def test_custom_fwd_function_behaves_under_the_plugin(
    cast_inputs: torch.dtype | None, forward_seen: tuple, backward_seen: tuple
) -> None:
    """custom_fwd sees the plugin's CPU autocast: cast_inputs=fp32 runs both passes in fp32 with autocast off."""
    function = make_square_function(cast_inputs)
    model = CustomFunctionModel(function)
    before = model.stem.weight.detach().clone()
    trainer = fit(model, MixedPrecision("bf16-mixed"), max_steps=2)
    assert model.output_dtypes["stem"] == torch.bfloat16  # the plugin's autocast was on around the function
    assert model.output_dtypes["custom"] == forward_seen[0]
    assert function.seen["forward"] == forward_seen
    assert function.seen["backward"] == backward_seen  # custom_bwd replays the forward's autocast state
    assert trainer.precision_plugin.stats.skipped_steps == 0
    assert not torch.equal(model.stem.weight, before)


# ------------------------------------------------------------------------------------------------ the model after fit

OPT_LEVELS = ["O1", "O2", "O3", "lean"]
LOAD_WITHOUT_THE_PACKAGE = """
import importlib.abc, sys, torch

class RefuseThePackage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "lightning_mp":
            raise ImportError(f"{name} is not installed here")

sys.meta_path.insert(0, RefuseThePackage())
model = torch.load(sys.argv[1], weights_only=False)
print(type(model).__name__, sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()))
"""


def boring_model() -> BoringModel:
    """Lightning's BoringModel (importable where this package is not) with a norm and a head to keep in fp32."""
    torch.manual_seed(0)
    model = BoringModel()
    model.layer = nn.Sequential(nn.Linear(32, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    return model


def fit_boring_model(opt_level: str) -> BoringModel:
    model = boring_model()
    make_trainer(MixedPrecision("bf16-mixed", opt_level=opt_level, keep_fp32=["layer.2"]), max_steps=2).fit(model)
    return model


def assert_plain_and_exportable(model: nn.Module, layers: nn.Sequential) -> None:
    """No hook and no object of this package; TorchScript and torch.export take it."""
    assert hook_count(model) == 0
    saved = io.BytesIO()
    torch.save(model, saved)
    assert b"lightning_mp" not in saved.getvalue()
    example = torch.randn(2, 32, dtype=layers[0].weight.dtype)
    layers[2].to(example.dtype)  # O3 and lean leave the kept head fp32 behind a half norm: align it to export
    torch.jit.script(layers)
    torch.export.export(model, (example,))


@pytest.mark.slow
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_after_fit_the_model_is_plain_torch_and_exports(opt_level: str) -> None:
    """After fit, with keep_fp32 at any opt level, the model holds no hook of the plugin and exports as usual."""
    model = fit_boring_model(opt_level)
    assert hook_count(model) == 0
    assert model.to_torchscript() is not None
    assert_plain_and_exportable(model, model.layer)


class FailingBoringModel(BoringModel):
    """Raises in its first training step."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise RuntimeError("the user's training step failed")


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_after_a_failed_fit_the_model_holds_no_hook(opt_level: str) -> None:
    """A fit that raises in training_step still leaves the model without the plugin's hooks."""
    torch.manual_seed(0)
    model = FailingBoringModel()
    model.layer = nn.Sequential(nn.Linear(32, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level=opt_level, keep_fp32=["layer.2"]))
    with pytest.raises(RuntimeError, match="training step failed"):
        trainer.fit(model)
    assert hook_count(model) == 0


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_validate_after_fit_runs_with_the_hooks_again_and_leaves_none(opt_level: str) -> None:
    """trainer.validate after fit converts the model again for its run (fp32 batches) and leaves it plain."""
    model = fit_boring_model(opt_level)
    trainer = make_trainer(MixedPrecision("bf16-mixed", opt_level=opt_level, keep_fp32=["layer.2"]))
    trainer.validate(model, verbose=False)
    assert hook_count(model) == 0


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_after_fabric_teardown_the_module_is_plain_torch_and_exports(opt_level: str) -> None:
    """Under Fabric, plugin.teardown() at the end of training leaves the module without hooks, ready to export."""
    plugin = MixedPrecision("bf16-mixed", opt_level=opt_level, keep_fp32=["2"])
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    module, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(module(torch.randn(4, 32)).float().square().mean())
    optimizer.step()
    assert hook_count(model) > 0  # the regions and casts the opt level needs while training
    plugin.teardown()
    assert_plain_and_exportable(model, model)


@pytest.mark.slow
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_a_model_saved_after_fit_loads_where_the_package_is_not_installed(opt_level: str, tmp_path: Path) -> None:
    """torch.save(model) after fit gives a file that a process without lightning_mp loads."""
    path = tmp_path / "model.pt"
    torch.save(fit_boring_model(opt_level), path)
    script = tmp_path / "load.py"
    script.write_text(LOAD_WITHOUT_THE_PACKAGE)
    loaded = subprocess.run(
        [sys.executable, "-I", str(script), str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["BoringModel", "0"]


RENAMED_BACKEND = """
import torch
torch.utils.rename_privateuse1_backend("npu9")
from lightning_mp.overrides import _autocast_device_types
print(",".join(_autocast_device_types()))
"""


@pytest.mark.slow
def test_keep_fp32_regions_know_an_out_of_tree_device_by_its_registered_name() -> None:
    """A backend registered under its own name (torch.utils.rename_privateuse1_backend) is among the device types
    whose autocast a keep_fp32 region switches off."""
    root = Path(__file__).parents[1]
    done = subprocess.run(
        [sys.executable, "-c", RENAMED_BACKEND], capture_output=True, text=True, check=True, cwd=root, timeout=120
    )
    assert done.stdout.strip().split(",")[-1] == "npu9" and "cuda" in done.stdout
