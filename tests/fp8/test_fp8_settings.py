"""The FP8 mode's refusals: each names the argument, the value and the fix."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from lightning_mp.fp8.convert import fp8_unavailable

if fp8_unavailable() is not None:  # torchao below its torch floor may fail to import with other errors than ImportError
    pytest.skip(f"the FP8 mode {fp8_unavailable()}", allow_module_level=True)
pytest.importorskip("torchao")

from lightning_mp import MixedPrecision
from lightning_mp.arguments.checks import arguments_of
from lightning_mp.fp8 import FP8Settings
from lightning_mp.fp8 import convert as fp8_convert


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"recipe": "rowwize"}, ["recipe='rowwize'", "'tensorwise', 'rowwise', 'rowwise_with_gw_hp'", "rowwise"]),
        ({"exclude": "lm_head"}, ["exclude='lm_head'", "['lm_head'"]),
        ({"exclude": ["re:("]}, ["'re:('", "regular expression"]),
        ({"exclude": [3]}, ["3", "nn.Module subclass"]),
        ({"keep_first_last": "no"}, ["keep_first_last='no'", "True or False"]),
        ({"fallback_max_underflow": 2}, ["fallback_max_underflow=2", "<= 1"]),
        ({"fallback_min_sqnr_db": float("nan")}, ["fallback_min_sqnr_db=nan", "finite"]),
        ({"fallback_patience": 0}, ["fallback_patience=0", ">= 1"]),
        ({"recipe": "rowwise", "fsdp_float8_all_gather": True}, ["fsdp_float8_all_gather=True", "'tensorwise'"]),
    ],
)
def test_bad_fp8_settings_name_the_argument_the_value_and_what_is_allowed(kwargs, named):
    """A wrong FP8 setting fails at construction, saying which argument, which value and what would work."""
    with pytest.raises(ValueError) as error:
        FP8Settings(**kwargs)
    for text in named:
        assert text in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"precision": "16-mixed"}, ["precision='16-mixed'", "'bf16-mixed'"]),
        ({"precision": "32-true"}, ["precision='32-true'", "'bf16-mixed'"]),
        ({"precision": "auto"}, ["precision='auto'", "'bf16-mixed'"]),
        ({"opt_level": "O3"}, ["opt_level='O3'", "'O1'", "'O2'"]),
        ({"opt_level": "lean"}, ["opt_level='lean'", "'O1'"]),
        ({"opt_level": "O0"}, ["opt_level='O0'", "'O1'"]),
        ({"fp8": "fp8"}, ["fp8='fp8'", "'tensorwise'", "FP8Settings"]),
    ],
)
def test_plugin_refuses_what_fp8_does_not_combine_with(kwargs, named):
    """fp16, fp32, 'auto', opt levels other than O1/O2 and unknown recipes are refused by name, with the fix."""
    arguments = {"precision": "bf16-mixed", "fp8": "tensorwise", **kwargs}
    with pytest.raises(ValueError) as error:
        MixedPrecision(**arguments)
    for text in named:
        assert text in str(error.value)


def test_o1_and_o2_combine_with_every_recipe():
    """bf16-mixed with O1 or O2 accepts each recipe, as a name or as FP8Settings."""
    for opt_level in ("O1", "O2"):
        for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
            assert MixedPrecision("bf16-mixed", opt_level=opt_level, fp8=recipe).fp8_settings.recipe == recipe
    settings = FP8Settings(recipe="rowwise", exclude=["net.2"])
    assert MixedPrecision("bf16-mixed", fp8=settings).fp8_settings is settings


def test_missing_torchao_names_the_fp8_extra(monkeypatch):
    """Without torchao, asking for fp8 says which extra to install."""

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(fp8_convert, "version", not_installed)
    with pytest.raises(
        ModuleNotFoundError, match=r'fp8=\'tensorwise\'.*pip install -e "\.\[fp8\]".*pip install "torchao>=0\.18\.0"'
    ):
        MixedPrecision("bf16-mixed", fp8="tensorwise")


def test_old_torch_or_torchao_is_refused_with_both_versions(monkeypatch):
    """Below the mode's floor the error names the version found and the one needed."""
    monkeypatch.setattr(torch, "__version__", "2.10.0+cpu")
    with pytest.raises(RuntimeError, match=r"torch >= 2\.11\.0.*torch 2\.10\.0\+cpu"):
        MixedPrecision("bf16-mixed", fp8="tensorwise")
    monkeypatch.undo()
    monkeypatch.setattr(fp8_convert, "version", lambda name: "0.15.0")
    with pytest.raises(RuntimeError, match=r"torchao >= 0\.18\.0; this is torchao 0\.15\.0"):
        MixedPrecision("bf16-mixed", fp8="rowwise")


def test_gpu_without_fp8_tensor_cores_is_refused_with_what_to_use(monkeypatch):
    """An A100 (compute capability 8.0) is refused, naming the GPU, its capability and bf16 as the alternative."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RuntimeError) as error, arguments_of("MixedPrecision"):
        fp8_convert.check_fp8_device("tensorwise", "cuda")
    for text in ("A100", "compute capability 8.0", ">= 8.9", "MixedPrecision('bf16-mixed')"):
        assert text in str(error.value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fp8_convert.check_fp8_device("tensorwise", "cuda")
    with pytest.raises(RuntimeError, match="'mps'"):
        fp8_convert.check_fp8_device("tensorwise", "mps")


def test_float8_all_gather_without_fsdp2_is_refused_with_the_fix():
    """The float8 all-gather is FSDP2's: on a model FSDP2 does not shard it is refused, naming fp8_convert."""
    from tests.fp8.plugin_models import TinyMlp, regression_loader
    from tests.helpers import make_trainer

    plugin = MixedPrecision("bf16-mixed", fp8=FP8Settings(fsdp_float8_all_gather=True))
    with pytest.raises(ValueError, match=r"fsdp_float8_all_gather=True.*plugin\.fp8_convert\(self\)"):
        make_trainer(plugin, max_steps=1).fit(TinyMlp(), regression_loader())
