"""Every upstream test of torch's GradScaler and of Lightning's precision plugins, and what this package does with it.

torch's grad-scaling tests and Lightning's precision-plugin tests describe how a loss scaler and an AMP plugin
behave. Users rely on that behaviour. The package runs them, rewritten against :class:`~lightning_mp.LossScaler` and
:class:`~lightning_mp.MixedPrecision`, in five modules under ``tests/``: ``scaling/test_scaler_upstream.py`` and
``scaling/test_scaler_upstream_side_by_side.py``, ``plugin/test_plugin_upstream.py``,
``engine/test_fabric_upstream.py`` and ``distributed/test_fsdp_upstream.py``. This module is the one list of what was
done with each upstream test, and why:

* ``adapted``: the upstream assertions hold here. Mocks are replaced by real runs, CUDA by the CPU, private torch
  calls by the public API.
* ``differs``: this package deliberately behaves otherwise. The local tests assert the package's behaviour, and the
  reason says what differs.
* ``skipped``: nothing here to test. The test needs CUDA, or tests a private helper, another plugin or a newer
  Lightning API.

A ``name`` of ``"*"`` stands for every test of a file that concerns another plugin. ``local`` names the tests that
adapt an entry, as ``"<module>::<test function>"``. ``tests/test_upstream_inventory.py`` checks that each one exists
and names its upstream test in its docstring, and that every test of the four modules is listed here.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Status = Literal["adapted", "differs", "skipped"]

TORCH_TESTS = "pytorch/pytorch test/test_torch.py"
CUDA_TESTS = "pytorch/pytorch test/test_cuda.py"
_PL = "Lightning-AI/pytorch-lightning tests/tests_pytorch/"
_FABRIC = "Lightning-AI/pytorch-lightning tests/tests_fabric/"
PL_AMP = _PL + "plugins/precision/test_amp.py"
PL_AMP_INTEGRATION = _PL + "plugins/precision/test_amp_integration.py"
PL_ALL = _PL + "plugins/precision/test_all.py"
PL_FSDP = _PL + "plugins/precision/test_fsdp.py"
PL_AMP_PLUGINS = _PL + "plugins/test_amp_plugins.py"
PL_MANUAL = _PL + "trainer/optimization/test_manual_optimization.py"
FABRIC_AMP = _FABRIC + "plugins/precision/test_amp.py"
FABRIC_AMP_INTEGRATION = _FABRIC + "plugins/precision/test_amp_integration.py"
FABRIC_ALL = _FABRIC + "plugins/precision/test_all.py"
FABRIC_FSDP = _FABRIC + "plugins/precision/test_fsdp.py"

SCALER = "scaling/test_scaler_upstream.py"
SCALER_SIDE_BY_SIDE = "scaling/test_scaler_upstream_side_by_side.py"
"""torch's scaler tests run beside torch's own scaler; the others are in :data:`SCALER`."""
PLUGIN = "plugin/test_plugin_upstream.py"
FABRIC = "engine/test_fabric_upstream.py"
FSDP = "distributed/test_fsdp_upstream.py"


@dataclass(frozen=True)
class UpstreamTest:
    """One upstream test (or, with ``name="*"``, a whole file) and what this package does with it."""

    source: str
    """``"<repository> <path>"`` of the upstream test file."""
    name: str
    status: Status
    reason: str
    local: tuple[str, ...] = ()
    """The tests that adapt it, ``"<module>::<function>"``; none for a skipped entry."""


def _test_names(module: str) -> frozenset[str]:
    tree = ast.parse((Path(__file__).parent / module).read_text())
    return frozenset(node.name for node in tree.body if isinstance(node, ast.FunctionDef))


def _at(module: str, *names: str) -> tuple[str, ...]:
    """``"<module>::<name>"`` for each name; torch's scaler tests are found in whichever of their two modules."""
    if module != SCALER:
        return tuple(f"{module}::{name}" for name in names)
    beside = _test_names(SCALER_SIDE_BY_SIDE)
    return tuple(f"{SCALER_SIDE_BY_SIDE if name in beside else SCALER}::{name}" for name in names)


_NO_ENABLED_FLAG = (
    "LossScaler has no enabled=False. torch's disabled pass runs as mode='check' (bf16, fp32): nothing scaled, the"
    " scale stays 1, but a non-finite step is still skipped, so the control skips it too"
)

_TORCH_SCALING_CASES = _at(
    SCALER,
    "test_autocast_training_matches_fp32_training_within_fp16_rounding",
    "test_clipping_the_scaled_gradients_by_a_scaled_norm_matches_clipping_true_ones",
    "test_unscale_then_clip_matches_clipping_fp32_gradients",
    "test_gradient_penalty_from_scaled_autograd_grad_matches_fp32",
    "test_accumulating_two_scaled_backwards_per_step_matches_fp32",
    "test_two_models_two_losses_two_optimizers_match_fp32",
)

_AT_EVERY_FP16_LEVEL = (
    "; at O1, O2 and O3. O3 is a strict xfail on the torch releases whose fused CPU SGD skips half weights (issue 28,"
    " defect 4): it turns into a failure once the package keeps half weights off that kernel there"
)

_OTHER_PLUGIN = "tests another precision plugin (or another accelerator's), not the AMP plugin this package replaces"

INVENTORY: tuple[UpstreamTest, ...] = (
    # ---------------------------------------------------------------- torch: test/test_torch.py (CPU and CUDA)
    UpstreamTest(
        TORCH_TESTS,
        "_run_scaling_case",
        "differs",
        "the shared body of torch's scaling cases: " + _NO_ENABLED_FLAG,
        _TORCH_SCALING_CASES,
    ),
    UpstreamTest(
        TORCH_TESTS,
        "test_grad_scaling_unscale",
        "adapted",
        "torch drives its private kernels (_amp_foreach_non_finite_check_and_unscale_, _unscale_grads_); here the"
        " public unscale_ and found_inf, and fp16 gradients through allow_fp16_gradients (O3's switch)",
        _at(
            SCALER,
            "test_unscale_divides_every_layout_and_finds_an_inf_or_nan_in_any",
            "test_unscale_sorts_mixed_dtypes_and_layouts_and_finds_an_inf_in_any",
            "test_unscale_refuses_fp16_gradients_by_default",
            "test_unscale_finds_inf_and_nan_and_leaves_finite_gradients_unscaled",
        ),
    ),
    UpstreamTest(
        TORCH_TESTS,
        "test_grad_scaling_update_scale",
        "adapted",
        "torch calls its private _amp_update_scale_; here real steps and update()",
        _at(SCALER, "test_update_grows_after_growth_interval_clean_iterations_and_backs_off_on_an_overflow"),
    ),
    UpstreamTest(
        TORCH_TESTS,
        "test_grad_scaling_unscale_sparse",
        "adapted",
        "through the public unscale_ instead of the private _unscale_grads_",
        _at(SCALER, "test_unscale_handles_sparse_gradients_and_finds_an_overflow_of_their_coalesced_sum"),
    ),
    UpstreamTest(
        TORCH_TESTS,
        "test_grad_scaling_state_dict",
        "differs",
        "torch adopts the loaded growth_factor, backoff_factor and growth_interval; LossScaler keeps this run's and"
        " warns, naming each that differs (the run's configuration wins over a checkpoint's); scale and tracker load",
        _at(
            SCALER,
            "test_load_state_dict_takes_the_scale_and_tracker_but_keeps_this_runs_factors",
            "test_state_dict_round_trips_with_torch_in_both_directions",
        ),
    ),
    UpstreamTest(
        TORCH_TESTS,
        "test_grad_scaling_autocast",
        "adapted",
        "fp16 autocast on the CPU. SGD against the fp32 control. torch expects Adam and AdamW to miss that control at"
        " 1e-3, so they (and every fused form) are compared with torch's GradScaler on the same run instead. Older"
        " torch ran the foreach and fused forms as test_cuda.py's test_grad_scaling_autocast_foreach and _fused",
        _at(
            SCALER,
            "test_autocast_training_matches_fp32_training_within_fp16_rounding",
            "test_adam_under_autocast_trains_as_with_torchs_scaler",
            "test_fused_optimizers_under_autocast_train_as_with_torchs_scaler",
        ),
    ),
    UpstreamTest(
        TORCH_TESTS,
        "test_grad_scaling_clipping",
        "adapted",
        "",
        _at(SCALER, "test_clipping_the_scaled_gradients_by_a_scaled_norm_matches_clipping_true_ones"),
    ),
    UpstreamTest(
        TORCH_TESTS,
        "test_grad_scaling_clipping_separate_unscale",
        "adapted",
        "also side by side with torch's scaler, fused Adam included",
        _at(SCALER, "test_unscale_then_clip_matches_clipping_fp32_gradients", "test_clipping_unscaled_gradients"),
    ),
    UpstreamTest(
        TORCH_TESTS,
        "test_grad_scaling_penalty",
        "adapted",
        "also side by side with torch's scaler",
        _at(
            SCALER,
            "test_gradient_penalty_from_scaled_autograd_grad_matches_fp32",
            "test_gradient_penalty_through_autograd_grad",
        ),
    ),
    UpstreamTest(
        TORCH_TESTS,
        "test_grad_scaling_accumulation",
        "adapted",
        "also side by side with torch's scaler, with momentum",
        _at(
            SCALER,
            "test_accumulating_two_scaled_backwards_per_step_matches_fp32",
            "test_gradient_accumulation_over_several_backwards",
        ),
    ),
    UpstreamTest(
        TORCH_TESTS,
        "test_grad_scaling_multiple",
        "adapted",
        "also side by side with torch's scaler (fused Adam, an optimizer unscaled and never stepped)",
        _at(
            SCALER,
            "test_two_models_two_losses_two_optimizers_match_fp32",
            "test_multiple_models_losses_and_optimizers",
            "test_an_optimizer_unscaled_found_to_overflow_and_not_stepped_still_backs_off",
        ),
    ),
    UpstreamTest(
        TORCH_TESTS,
        "test_grad_scaler_pass_itself",
        "adapted",
        "also the grad_scale a user sets on a fused optimizer",
        _at(
            SCALER,
            "test_a_custom_optimizer_declaring_amp_scaling_gets_torchs_hand_off",
            "test_a_grad_scale_set_on_a_fused_optimizer_divides_the_gradients_too",
        ),
    ),
    UpstreamTest(
        TORCH_TESTS,
        "test_grad_scaler_deprecated_warning",
        "skipped",
        "tests the deprecation of torch.cuda.amp.GradScaler and torch.cpu.amp.GradScaler, aliases LossScaler is not",
    ),
    # ---------------------------------------------------------------- torch: test/test_cuda.py (CUDA only upstream)
    UpstreamTest(
        CUDA_TESTS,
        "test_grad_scaling_scale",
        "adapted",
        "on one CPU device; its second GPU and the private _scale's device are left out",
        _at(SCALER, "test_scale_multiplies_every_tensor_of_nested_outputs"),
    ),
    UpstreamTest(
        CUDA_TESTS,
        "test_grad_scaling_autocast_fused_optimizers",
        "adapted",
        "on the CPU's fused Adam and AdamW kernels",
        _at(SCALER, "test_fused_adam_unscaling_inside_its_kernel_matches_the_unfused_one"),
    ),
    UpstreamTest(
        CUDA_TESTS,
        "test_params_invalidated_with_grads_invalidated_between_unscale_and_step",
        "adapted",
        "the bare scaler behaves as torch's; the plugin itself rechecks clipped gradients (recheck_gradients)",
        _at(SCALER, "test_gradients_broken_after_unscale_reach_the_weights_as_in_torch"),
    ),
    UpstreamTest(
        CUDA_TESTS,
        "test_grad_scale_will_not_overflow",
        "differs",
        "torch accepts init_scale=1e38 and keeps it where growth would overflow. LossScaler refuses an init_scale"
        " above max_scale (2**24 by default) and caps growth at max_scale. The scale stays finite in both",
        _at(SCALER, "test_a_huge_scale_stays_finite_after_growing"),
    ),
    UpstreamTest(
        CUDA_TESTS,
        "test_grad_scaling_device_as_key",
        "skipped",
        "CUDA-only: tests that torch.device objects of two GPUs hash as dict keys; no scaler involved",
    ),
    UpstreamTest(CUDA_TESTS, "test_grad_scaling_multigpu", "skipped", "CUDA-only: needs two GPUs"),
    UpstreamTest(CUDA_TESTS, "test_graph_grad_scaling", "skipped", "CUDA-only: captures the step in a CUDA graph"),
    # ---------------------------------------------------------------- Lightning: the Trainer's AMP plugin
    UpstreamTest(
        PL_AMP,
        "test_clip_gradients",
        "adapted",
        "real gradients and scaler instead of mocked clip_grad_by_value/clip_grad_by_norm",
        _at(
            PLUGIN,
            "test_clip_gradients_is_a_no_op_when_clipping_is_off",
            "test_clip_gradients_by_value_and_by_norm_clip_the_true_gradients",
        ),
    ),
    UpstreamTest(
        PL_AMP,
        "test_optimizer_amp_scaling_support_in_step_method",
        "differs",
        "Lightning refuses to clip a fused optimizer's gradients (RuntimeError); this plugin unscales them first,"
        " clips, and the fused step does not unscale again",
        _at(PLUGIN, "test_a_fused_optimizer_clips_then_steps_without_unscaling_again"),
    ),
    UpstreamTest(
        PL_AMP,
        "test_amp_with_no_grad",
        "adapted",
        "",
        _at(PLUGIN, "test_a_no_grad_forward_inside_the_forward_context_keeps_later_gradients"),
    ),
    UpstreamTest(
        PL_AMP,
        "test_amp_with_inference_mode",
        "adapted",
        "",
        _at(PLUGIN, "test_a_no_grad_forward_inside_the_forward_context_keeps_later_gradients"),
    ),
    UpstreamTest(
        PL_AMP,
        "test_amp_forward_context_restores_grad_mode_context_managers",
        "skipped",
        "Lightning after 2.6 patches torch.no_grad and inference_mode inside forward_context; this plugin, like"
        " Lightning 2.6.6 which it targets, turns the autocast cache off instead, so nothing is patched or restored",
    ),
    UpstreamTest(
        PL_AMP,
        "test_torch_autocast_cache_behavior_with_no_grad",
        "skipped",
        "documents torch's autocast cache alone; no plugin involved",
    ),
    UpstreamTest(
        PL_AMP,
        "test_torch_autocast_cache_behavior_with_no_grad_cuda",
        "skipped",
        "CUDA-only, and torch's autocast alone",
    ),
    UpstreamTest(PL_AMP, "test_amp_with_no_grad_cuda", "skipped", "CUDA-only copy of test_amp_with_no_grad"),
    UpstreamTest(
        PL_AMP,
        "test_amp_autocast_context_manager_disables_cache",
        "adapted",
        "",
        _at(PLUGIN, "test_autocast_context_manager_disables_the_cache"),
    ),
    UpstreamTest(
        PL_AMP,
        "test_amp_forward_context_keeps_cache_enabled",
        "differs",
        "Lightning after 2.6 keeps the autocast cache on in forward_context; this plugin keeps it off there, as"
        " Lightning 2.6.6 does, which is what keeps a no_grad forward from breaking the next one's gradients",
        _at(PLUGIN, "test_the_forward_context_runs_without_the_autocast_cache"),
    ),
    UpstreamTest(
        PL_AMP_INTEGRATION,
        "test_amp_fused_optimizer_parity",
        "adapted",
        "fp16 on the CPU instead of CUDA",
        _at(PLUGIN, "test_fused_and_plain_adam_give_the_same_weights_in_fp16"),
    ),
    UpstreamTest(
        PL_AMP_INTEGRATION,
        "test_skip_training_step_with_grad_scaler",
        "adapted",
        "a LossScaler subclass counts the calls instead of Mock(wraps=scaler); fp16 on the CPU, at O1 and O2",
        _at(PLUGIN, "test_a_skipped_training_step_skips_the_scaler_too"),
    ),
    UpstreamTest(
        PL_ALL,
        "test_default_dtype_is_restored",
        "adapted",
        "upstream covers the '-true' plugins; here every opt level's init contexts, and FSDPMixedPrecision's",
        _at(PLUGIN, "test_the_init_contexts_leave_the_default_dtype_fp32_also_after_an_exception")
        + _at(FSDP, "test_the_fsdp_init_contexts_keep_the_default_dtype_fp32_also_after_an_exception"),
    ),
    UpstreamTest(
        PL_AMP_PLUGINS,
        "test_amp_ddp",
        "adapted",
        "2 CPU processes, nothing launched, instead of a mocked SLURM job on 2 GPUs",
        _at(PLUGIN, "test_the_trainer_keeps_the_plugin_and_its_subclasses_under_ddp"),
    ),
    UpstreamTest(
        PL_AMP_PLUGINS,
        "test_amp_gradient_unscale",
        "adapted",
        "one CPU device instead of ddp_spawn on 2 GPUs, at O1 and O2; the public is_unscaled instead of the private"
        " _per_optimizer_states",
        _at(
            PLUGIN,
            "test_hooks_see_unscaled_gradients_and_the_step_gets_the_clipped_ones",
            "test_gradient_accumulation_unscales_once_per_optimizer_step",
        ),
    ),
    UpstreamTest(
        PL_AMP_PLUGINS,
        "test_amp_skip_optimizer",
        "adapted",
        "fp16 on the CPU" + _AT_EVERY_FP16_LEVEL,
        _at(PLUGIN, "test_an_optimizer_that_never_steps_is_left_alone"),
    ),
    UpstreamTest(
        PL_AMP_PLUGINS,
        "test_cpu_amp_precision_context_manager",
        "adapted",
        "",
        _at(PLUGIN, "test_a_bf16_plugin_on_the_cpu_autocasts_to_bf16_without_a_scaler"),
    ),
    UpstreamTest(
        PL_AMP_PLUGINS,
        "test_amp_precision_plugin_parameter_validation",
        "differs",
        "the same values are refused with ValueError; the message differs from Lightning's (it lists 'auto' and"
        " '32-true' too, and suggests the full name meant)",
        _at(PLUGIN, "test_a_precision_name_lightning_refuses_is_refused_with_the_name_to_use"),
    ),
    UpstreamTest(
        PL_MANUAL,
        "test_multiple_optimizers_step",
        "adapted",
        "fp16 on the CPU, at O1, O2 and O3",
        _at(PLUGIN, "test_manual_optimization_steps_several_optimizers_over_shared_parameters"),
    ),
    UpstreamTest(
        PL_MANUAL,
        "test_manual_optimization_and_accumulated_gradient",
        "adapted",
        "fp16 on the CPU" + _AT_EVERY_FP16_LEVEL,
        _at(PLUGIN, "test_manual_optimization_with_accumulated_gradients_steps_every_fourth_batch"),
    ),
    *(
        UpstreamTest(_PL + "plugins/precision/" + file, "*", "skipped", _OTHER_PLUGIN)
        for file in (
            "test_half.py",
            "test_double.py",
            "test_bitsandbytes.py",
            "test_deepspeed_precision.py",
            "test_transformer_engine.py",
            "test_sharded_precision.py",
            "test_tpu.py",
            "test_tpu_bf16_plugin.py",
            "test_xla.py",
            "test_xlabf16.py",
            "hpu/test_hpu.py",
        )
    ),
    UpstreamTest(
        _PL + "plugins/precision/test_native_amp.py",
        "*",
        "skipped",
        "Lightning 1.x's name of test_amp.py; its two tests are the entries test_clip_gradients and"
        " test_optimizer_amp_scaling_support_in_step_method",
    ),
    UpstreamTest(
        _PL + "plugins/precision/test_native_amp_integration.py",
        "*",
        "skipped",
        "Lightning 1.x's name of test_amp_integration.py, whose tests are listed",
    ),
    # ---------------------------------------------------------------- Lightning: Fabric's AMP plugin
    UpstreamTest(
        FABRIC_AMP,
        "test_amp_precision_default_scaler",
        "differs",
        "Lightning builds a GradScaler in the constructor; this plugin builds its LossScaler (a GradScaler) at setup,"
        " when the device and the opt level are known",
        _at(FABRIC, "test_a_16_mixed_plugin_gets_its_loss_scaler_when_fabric_sets_it_up"),
    ),
    UpstreamTest(
        FABRIC_AMP,
        "test_amp_precision_scaler_with_bf16",
        "adapted",
        "",
        _at(FABRIC, "test_bf16_refuses_a_scaler_and_has_none"),
    ),
    UpstreamTest(
        FABRIC_AMP,
        "test_amp_precision_forward_context",
        "adapted",
        "its CPU part; forward_context wraps torch.autocast with the opt level's context, so the returned object is"
        " not checked to be a torch.autocast",
        _at(FABRIC, "test_the_forward_context_autocasts_on_the_cpu_in_the_half_dtype"),
    ),
    UpstreamTest(
        FABRIC_AMP,
        "test_amp_precision_backward",
        "adapted",
        "a real fabric.backward: scaled gradients and retain_graph passed on, instead of a mocked tensor",
        _at(FABRIC, "test_fabric_backward_scales_the_loss_and_passes_its_arguments_on"),
    ),
    UpstreamTest(
        FABRIC_AMP,
        "test_amp_precision_optimizer_step_with_scaler",
        "adapted",
        "a real step through the scaler; the weights and the counted scale update are checked",
        _at(FABRIC, "test_a_step_of_the_fabric_optimizer_goes_through_the_scaler"),
    ),
    UpstreamTest(
        FABRIC_AMP,
        "test_amp_precision_optimizer_step_without_scaler",
        "adapted",
        "",
        _at(FABRIC, "test_a_bf16_step_steps_the_optimizer_without_a_scaler"),
    ),
    UpstreamTest(
        FABRIC_AMP,
        "test_amp_precision_parameter_validation",
        "differs",
        "the Trainer's and Fabric's plugin are one class here; see test_amp_precision_plugin_parameter_validation",
        _at(PLUGIN, "test_a_precision_name_lightning_refuses_is_refused_with_the_name_to_use"),
    ),
    UpstreamTest(
        FABRIC_AMP_INTEGRATION,
        "test_amp",
        "differs",
        "Fabric casts the inputs to the half dtype and runs '16-mixed' on the CPU as bf16; this plugin leaves the"
        " inputs to autocast and runs real fp16 on the CPU. One process instead of ddp_spawn on two",
        _at(FABRIC, "test_fabric_computes_in_the_half_dtype_with_fp32_weights_gradients_and_outputs"),
    ),
    UpstreamTest(
        FABRIC_AMP_INTEGRATION,
        "test_amp_fused_optimizer_parity",
        "adapted",
        "fp16 on the CPU instead of CUDA",
        _at(FABRIC, "test_fused_and_plain_adam_give_the_same_losses_and_weights_in_fp16"),
    ),
    UpstreamTest(
        FABRIC_ALL,
        "test_default_dtype_is_restored",
        "adapted",
        "the Trainer's and Fabric's plugin are one class here",
        _at(PLUGIN, "test_the_init_contexts_leave_the_default_dtype_fp32_also_after_an_exception")
        + _at(FSDP, "test_the_fsdp_init_contexts_keep_the_default_dtype_fp32_also_after_an_exception"),
    ),
    UpstreamTest(
        _FABRIC + "plugins/precision/test_compute_dtype.py",
        "*",
        "skipped",
        "Precision.compute_dtype() came after Lightning 2.6.6, which this package targets",
    ),
    UpstreamTest(
        _FABRIC + "plugins/precision/test_utils.py",
        "*",
        "skipped",
        "tests Lightning's private helpers (_DtypeContextManager, _ClassReplacementContextManager)",
    ),
    *(
        UpstreamTest(_FABRIC + "plugins/precision/" + file, "*", "skipped", _OTHER_PLUGIN)
        for file in (
            "test_half.py",
            "test_double.py",
            "test_double_integration.py",
            "test_bitsandbytes.py",
            "test_deepspeed.py",
            "test_deepspeed_integration.py",
            "test_transformer_engine.py",
            "test_tpu_bf16.py",
            "test_xla.py",
            "test_xla_integration.py",
            "test_xlabf16.py",
            "test_itrex.py",
            "test_weight_only.py",
        )
    ),
    UpstreamTest(
        _FABRIC + "plugins/precision/test_native_amp.py",
        "*",
        "skipped",
        "Lightning 1.x's name of test_amp.py, whose tests are listed",
    ),
    UpstreamTest(
        _FABRIC + "plugins/precision/test_native_amp_integration.py",
        "*",
        "skipped",
        "Lightning 1.x's name of test_amp_integration.py, whose tests are listed",
    ),
    # ---------------------------------------------------------------- Lightning: the FSDP precision plugins
    *(
        entry
        for source, front in ((PL_FSDP, "trainer"), (FABRIC_FSDP, "fabric"))
        for entry in (
            UpstreamTest(
                source,
                "test_fsdp_precision_config",
                "differs",
                "FSDP's dtypes follow the opt level: O1 keeps FSDP in fp32 (reductions too, as under DDP) where"
                " Lightning reduces and keeps buffers in half; O2 gathers and reduces in half, buffers fp32. '16-true'"
                " and 'bf16-true' are not precisions of this plugin (O3 and lean are refused under FSDP)",
                _at(
                    FSDP,
                    "test_the_fsdp_config_follows_the_opt_level",
                    "test_half_weight_precisions_are_refused_naming_o2",
                ),
            ),
            UpstreamTest(
                source,
                "test_fsdp_precision_default_scaler",
                "differs",
                "Lightning builds torch's ShardedGradScaler in the constructor; this plugin builds a sharding-aware"
                " LossScaler at setup (each rank checks its shards, one all-reduce makes every rank skip together)",
                _at(FSDP, "test_the_fp16_scaler_is_a_sharding_aware_loss_scaler_built_at_setup"),
            ),
            UpstreamTest(
                source,
                "test_fsdp_precision_scaler_with_bf16",
                "adapted",
                "",
                _at(FSDP, "test_bf16_under_fsdp_refuses_a_scaler_and_has_none"),
            ),
            UpstreamTest(
                source,
                "test_fsdp_precision_forward_context",
                "adapted",
                "its mixed cases on the CPU instead of CUDA; its '-true' cases are refused here (see"
                " test_fsdp_precision_config)",
                _at(FSDP, "test_the_forward_context_autocasts_in_the_half_dtype"),
            ),
            UpstreamTest(
                source,
                "test_fsdp_precision_backward",
                "adapted",
                "a real one-process FSDP run instead of mocks",
                _at(
                    FSDP,
                    "test_trainer_fsdp_scales_before_backward_unscales_before_the_step_and_skips_an_inf"
                    if front == "trainer"
                    else "test_fabric_fsdp_backward_scales_the_loss_and_a_step_skips_an_inf",
                ),
            ),
            UpstreamTest(
                source,
                "test_fsdp_precision_optimizer_step_with_scaler",
                "adapted",
                "a real one-process FSDP run: an inf skips the step, a clean one moves the weights",
                _at(
                    FSDP,
                    "test_trainer_fsdp_scales_before_backward_unscales_before_the_step_and_skips_an_inf"
                    if front == "trainer"
                    else "test_fabric_fsdp_backward_scales_the_loss_and_a_step_skips_an_inf",
                ),
            ),
            UpstreamTest(
                source,
                "test_fsdp_precision_optimizer_step_without_scaler",
                "adapted",
                "a real one-process FSDP run in bf16",
                _at(FSDP, "test_bf16_under_fsdp_steps_without_a_scaler"),
            ),
            UpstreamTest(
                source,
                "test_invalid_precision_with_fsdp_precision",
                "adapted",
                "",
                _at(FSDP, "test_a_precision_fsdp_cannot_run_is_refused_naming_the_allowed_ones"),
            ),
        )
    ),
)
"""What this package does with every upstream test; ``tests/test_upstream_inventory.py`` keeps it true."""
