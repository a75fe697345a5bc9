"""Lightning's precision-plugin tests (the Trainer's, Fabric's and the FSDP plugins') and what this package does with
each."""

from __future__ import annotations

from tests.upstream_inventory.entries import (
    _AT_EVERY_FP16_LEVEL,
    _FABRIC,
    _OTHER_PLUGIN,
    _PL,
    FABRIC,
    FABRIC_ALL,
    FABRIC_AMP,
    FABRIC_AMP_INTEGRATION,
    FABRIC_FSDP,
    FSDP,
    PL_ALL,
    PL_AMP,
    PL_AMP_INTEGRATION,
    PL_AMP_PLUGINS,
    PL_FSDP,
    PL_MANUAL,
    PLUGIN,
    UpstreamTest,
    local_tests,
)

LIGHTNING_INVENTORY: tuple[UpstreamTest, ...] = (
    # ---------------------------------------------------------------- Lightning: the Trainer's AMP plugin
    UpstreamTest(
        PL_AMP,
        "test_clip_gradients",
        "adapted",
        "real gradients and scaler instead of mocked clip_grad_by_value/clip_grad_by_norm",
        local_tests(
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
        local_tests(PLUGIN, "test_a_fused_optimizer_clips_then_steps_without_unscaling_again"),
    ),
    UpstreamTest(
        PL_AMP,
        "test_amp_with_no_grad",
        "adapted",
        "",
        local_tests(PLUGIN, "test_a_no_grad_forward_inside_the_forward_context_keeps_later_gradients"),
    ),
    UpstreamTest(
        PL_AMP,
        "test_amp_with_inference_mode",
        "adapted",
        "",
        local_tests(PLUGIN, "test_a_no_grad_forward_inside_the_forward_context_keeps_later_gradients"),
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
        local_tests(PLUGIN, "test_autocast_context_manager_disables_the_cache"),
    ),
    UpstreamTest(
        PL_AMP,
        "test_amp_forward_context_keeps_cache_enabled",
        "differs",
        "Lightning after 2.6 keeps the autocast cache on in forward_context; this plugin keeps it off there, as"
        " Lightning 2.6.6 does, which is what keeps a no_grad forward from breaking the next one's gradients",
        local_tests(PLUGIN, "test_the_forward_context_runs_without_the_autocast_cache"),
    ),
    UpstreamTest(
        PL_AMP_INTEGRATION,
        "test_amp_fused_optimizer_parity",
        "adapted",
        "fp16 on the CPU instead of CUDA",
        local_tests(PLUGIN, "test_fused_and_plain_adam_give_the_same_weights_in_fp16"),
    ),
    UpstreamTest(
        PL_AMP_INTEGRATION,
        "test_skip_training_step_with_grad_scaler",
        "adapted",
        "a LossScaler subclass counts the calls instead of Mock(wraps=scaler); fp16 on the CPU, at O1 and O2",
        local_tests(PLUGIN, "test_a_skipped_training_step_skips_the_scaler_too"),
    ),
    UpstreamTest(
        PL_ALL,
        "test_default_dtype_is_restored",
        "adapted",
        "upstream covers the '-true' plugins; here every opt level's init contexts, and FSDPMixedPrecision's",
        local_tests(PLUGIN, "test_the_init_contexts_leave_the_default_dtype_fp32_also_after_an_exception")
        + local_tests(FSDP, "test_the_fsdp_init_contexts_keep_the_default_dtype_fp32_also_after_an_exception"),
    ),
    UpstreamTest(
        PL_AMP_PLUGINS,
        "test_amp_ddp",
        "adapted",
        "2 CPU processes, nothing launched, instead of a mocked SLURM job on 2 GPUs",
        local_tests(PLUGIN, "test_the_trainer_keeps_the_plugin_and_its_subclasses_under_ddp"),
    ),
    UpstreamTest(
        PL_AMP_PLUGINS,
        "test_amp_gradient_unscale",
        "adapted",
        "one CPU device instead of ddp_spawn on 2 GPUs, at O1 and O2; the public is_unscaled instead of the private"
        " _per_optimizer_states",
        local_tests(
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
        local_tests(PLUGIN, "test_an_optimizer_that_never_steps_is_left_alone"),
    ),
    UpstreamTest(
        PL_AMP_PLUGINS,
        "test_cpu_amp_precision_context_manager",
        "adapted",
        "",
        local_tests(PLUGIN, "test_a_bf16_plugin_on_the_cpu_autocasts_to_bf16_without_a_scaler"),
    ),
    UpstreamTest(
        PL_AMP_PLUGINS,
        "test_amp_precision_plugin_parameter_validation",
        "differs",
        "the same values are refused with ValueError; the message differs from Lightning's (it lists 'auto' and"
        " '32-true' too, and suggests the full name meant)",
        local_tests(PLUGIN, "test_a_precision_name_lightning_refuses_is_refused_with_the_name_to_use"),
    ),
    UpstreamTest(
        PL_MANUAL,
        "test_multiple_optimizers_step",
        "adapted",
        "fp16 on the CPU, at O1, O2 and O3",
        local_tests(PLUGIN, "test_manual_optimization_steps_several_optimizers_over_shared_parameters"),
    ),
    UpstreamTest(
        PL_MANUAL,
        "test_manual_optimization_and_accumulated_gradient",
        "adapted",
        "fp16 on the CPU" + _AT_EVERY_FP16_LEVEL,
        local_tests(PLUGIN, "test_manual_optimization_with_accumulated_gradients_steps_every_fourth_batch"),
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
        local_tests(FABRIC, "test_a_16_mixed_plugin_gets_its_loss_scaler_when_fabric_sets_it_up"),
    ),
    UpstreamTest(
        FABRIC_AMP,
        "test_amp_precision_scaler_with_bf16",
        "adapted",
        "",
        local_tests(FABRIC, "test_bf16_refuses_a_scaler_and_has_none"),
    ),
    UpstreamTest(
        FABRIC_AMP,
        "test_amp_precision_forward_context",
        "adapted",
        "its CPU part; forward_context wraps torch.autocast with the opt level's context, so the returned object is"
        " not checked to be a torch.autocast",
        local_tests(FABRIC, "test_the_forward_context_autocasts_on_the_cpu_in_the_half_dtype"),
    ),
    UpstreamTest(
        FABRIC_AMP,
        "test_amp_precision_backward",
        "adapted",
        "a real fabric.backward: scaled gradients and retain_graph passed on, instead of a mocked tensor",
        local_tests(FABRIC, "test_fabric_backward_scales_the_loss_and_passes_its_arguments_on"),
    ),
    UpstreamTest(
        FABRIC_AMP,
        "test_amp_precision_optimizer_step_with_scaler",
        "adapted",
        "a real step through the scaler; the weights and the counted scale update are checked",
        local_tests(FABRIC, "test_a_step_of_the_fabric_optimizer_goes_through_the_scaler"),
    ),
    UpstreamTest(
        FABRIC_AMP,
        "test_amp_precision_optimizer_step_without_scaler",
        "adapted",
        "",
        local_tests(FABRIC, "test_a_bf16_step_steps_the_optimizer_without_a_scaler"),
    ),
    UpstreamTest(
        FABRIC_AMP,
        "test_amp_precision_parameter_validation",
        "differs",
        "the Trainer's and Fabric's plugin are one class here; see test_amp_precision_plugin_parameter_validation",
        local_tests(PLUGIN, "test_a_precision_name_lightning_refuses_is_refused_with_the_name_to_use"),
    ),
    UpstreamTest(
        FABRIC_AMP_INTEGRATION,
        "test_amp",
        "differs",
        "Fabric casts the inputs to the half dtype and runs '16-mixed' on the CPU as bf16; this plugin leaves the"
        " inputs to autocast and runs real fp16 on the CPU. One process instead of ddp_spawn on two",
        local_tests(FABRIC, "test_fabric_computes_in_the_half_dtype_with_fp32_weights_gradients_and_outputs"),
    ),
    UpstreamTest(
        FABRIC_AMP_INTEGRATION,
        "test_amp_fused_optimizer_parity",
        "adapted",
        "fp16 on the CPU instead of CUDA",
        local_tests(FABRIC, "test_fused_and_plain_adam_give_the_same_losses_and_weights_in_fp16"),
    ),
    UpstreamTest(
        FABRIC_ALL,
        "test_default_dtype_is_restored",
        "adapted",
        "the Trainer's and Fabric's plugin are one class here",
        local_tests(PLUGIN, "test_the_init_contexts_leave_the_default_dtype_fp32_also_after_an_exception")
        + local_tests(FSDP, "test_the_fsdp_init_contexts_keep_the_default_dtype_fp32_also_after_an_exception"),
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
                local_tests(
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
                local_tests(FSDP, "test_the_fp16_scaler_is_a_sharding_aware_loss_scaler_built_at_setup"),
            ),
            UpstreamTest(
                source,
                "test_fsdp_precision_scaler_with_bf16",
                "adapted",
                "",
                local_tests(FSDP, "test_bf16_under_fsdp_refuses_a_scaler_and_has_none"),
            ),
            UpstreamTest(
                source,
                "test_fsdp_precision_forward_context",
                "adapted",
                "its mixed cases on the CPU instead of CUDA; its '-true' cases are refused here (see"
                " test_fsdp_precision_config)",
                local_tests(FSDP, "test_the_forward_context_autocasts_in_the_half_dtype"),
            ),
            UpstreamTest(
                source,
                "test_fsdp_precision_backward",
                "adapted",
                "a real one-process FSDP run instead of mocks",
                local_tests(
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
                local_tests(
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
                local_tests(FSDP, "test_bf16_under_fsdp_steps_without_a_scaler"),
            ),
            UpstreamTest(
                source,
                "test_invalid_precision_with_fsdp_precision",
                "adapted",
                "",
                local_tests(FSDP, "test_a_precision_fsdp_cannot_run_is_refused_naming_the_allowed_ones"),
            ),
        )
    ),
)
