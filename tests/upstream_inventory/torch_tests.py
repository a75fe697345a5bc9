"""torch's grad-scaling tests (``test/test_torch.py``, ``test/test_cuda.py``) and what this package does with each."""

from __future__ import annotations

from tests.upstream_inventory.entries import (
    _NO_ENABLED_FLAG,
    _TORCH_SCALING_CASES,
    CUDA_TESTS,
    SCALER,
    TORCH_TESTS,
    UpstreamTest,
    local_tests,
)

TORCH_INVENTORY: tuple[UpstreamTest, ...] = (
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
        local_tests(
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
        local_tests(SCALER, "test_update_grows_after_growth_interval_clean_iterations_and_backs_off_on_an_overflow"),
    ),
    UpstreamTest(
        TORCH_TESTS,
        "test_grad_scaling_unscale_sparse",
        "adapted",
        "through the public unscale_ instead of the private _unscale_grads_",
        local_tests(SCALER, "test_unscale_handles_sparse_gradients_and_finds_an_overflow_of_their_coalesced_sum"),
    ),
    UpstreamTest(
        TORCH_TESTS,
        "test_grad_scaling_state_dict",
        "differs",
        "torch adopts the loaded growth_factor, backoff_factor and growth_interval; LossScaler keeps this run's and"
        " warns, naming each that differs (the run's configuration wins over a checkpoint's); scale and tracker load",
        local_tests(
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
        local_tests(
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
        local_tests(SCALER, "test_clipping_the_scaled_gradients_by_a_scaled_norm_matches_clipping_true_ones"),
    ),
    UpstreamTest(
        TORCH_TESTS,
        "test_grad_scaling_clipping_separate_unscale",
        "adapted",
        "also side by side with torch's scaler, fused Adam included",
        local_tests(
            SCALER, "test_unscale_then_clip_matches_clipping_fp32_gradients", "test_clipping_unscaled_gradients"
        ),
    ),
    UpstreamTest(
        TORCH_TESTS,
        "test_grad_scaling_penalty",
        "adapted",
        "also side by side with torch's scaler",
        local_tests(
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
        local_tests(
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
        local_tests(
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
        local_tests(
            SCALER,
            "test_a_custom_optimizer_declaring_amp_scaling_gets_torchs_fused_step",
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
        local_tests(SCALER, "test_scale_multiplies_every_tensor_of_nested_outputs"),
    ),
    UpstreamTest(
        CUDA_TESTS,
        "test_grad_scaling_autocast_fused_optimizers",
        "adapted",
        "on the CPU's fused Adam and AdamW kernels",
        local_tests(SCALER, "test_fused_adam_unscaling_inside_its_kernel_matches_the_unfused_one"),
    ),
    UpstreamTest(
        CUDA_TESTS,
        "test_params_invalidated_with_grads_invalidated_between_unscale_and_step",
        "adapted",
        "the bare scaler behaves as torch's; the plugin itself rechecks clipped gradients (recheck_gradients)",
        local_tests(SCALER, "test_gradients_broken_gradients_changed_reach_the_weights_as_in_torch"),
    ),
    UpstreamTest(
        CUDA_TESTS,
        "test_grad_scale_will_not_overflow",
        "differs",
        "torch accepts init_scale=1e38 and keeps it where growth would overflow. LossScaler refuses an init_scale"
        " above max_scale (2**24 by default) and caps growth at max_scale. The scale stays finite in both",
        local_tests(SCALER, "test_a_huge_scale_stays_finite_after_growing"),
    ),
    UpstreamTest(
        CUDA_TESTS,
        "test_grad_scaling_device_as_key",
        "skipped",
        "CUDA-only: tests that torch.device objects of two GPUs hash as dict keys; no scaler involved",
    ),
    UpstreamTest(CUDA_TESTS, "test_grad_scaling_multigpu", "skipped", "CUDA-only: needs two GPUs"),
    UpstreamTest(CUDA_TESTS, "test_graph_grad_scaling", "skipped", "CUDA-only: captures the step in a CUDA graph"),
)
