"""MixedPrecision under FSDP2 (Lightning's ModelParallelStrategy, ``fully_shard``) on the CPU, gloo, 2 processes.

Each test reads the report of ``ddp_scripts/fsdp2_train.py``, which trains the same model under DDP and under FSDP2
in the same two processes, with an inf planted on rank 1 at steps 2 and 5, and compares the two.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lightning_mp import MixedPrecision
from lightning_mp.policies.sharded import ShardedPrecisionError
from tests.ddp_scripts.launch import FSDP2_SUMS_OVER_GLOO_REASON, fsdp2_sums_over_gloo, reports, run
from tests.helpers import read_events, scalars

FSDP2_SCRIPT = Path(__file__).parents[1] / "ddp_scripts" / "fsdp2_train.py"
FABRIC_SCRIPT = Path(__file__).parents[1] / "ddp_scripts" / "fabric_train.py"
WORKING_CASES = ("32-true:O0", "16-mixed:O1", "bf16-mixed:O1", "16-mixed:O2", "bf16-mixed:O2")
INJECT_AT = (2, 5)
SENTINEL_TAGS = tuple(
    f"precision_sentinel/{name}"
    for name in ("total_grad_underflow_share", "max_stale_update_share", "min_activation_headroom_log2")
)


def _fsdp2_reports(out: Path, *arguments: str) -> list[dict[str, Any]]:
    run(["--out", str(out), *arguments], timeout=120, script=FSDP2_SCRIPT)
    return reports(out, tag="fsdp2_")


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Every working opt level under DDP and FSDP2, with the loss-scale and gradient-health monitors, the sentinel."""
    if fsdp2_sums_over_gloo():
        pytest.skip(FSDP2_SUMS_OVER_GLOO_REASON)
    out = tmp_path_factory.mktemp("fsdp2")
    return out, _fsdp2_reports(out, "--cases", ",".join(WORKING_CASES), "--telemetry")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """fp16 O1 and bf16 O2 under FSDP2, resumed at step 4; memory, host syncs and the refused combinations."""
    out = tmp_path_factory.mktemp("fsdp2-resume")
    arguments = ["--cases", "16-mixed:O1,bf16-mixed:O2", "--resume-at", "4", "--memory", "--counts", "--refusals"]
    return _fsdp2_reports(out, *arguments)


@pytest.mark.slow
@pytest.mark.parametrize("case", WORKING_CASES)
def test_fsdp2_trains_like_ddp(compared, case):
    """Under FSDP2 each opt level skips the same steps as under DDP (an inf on rank 1 only skipped by both ranks),
    with the same scales and counters, losses within 1e-3 and the same weights on every rank."""
    _, ranks = compared
    for rank in ranks:
        ddp, fsdp2 = rank[case]["ddp"], rank[case]["fsdp2"]
        assert fsdp2["steps"] == ddp["steps"]
        assert [step - 1 for step, _, skipped in fsdp2["steps"] if skipped] == list(INJECT_AT)
        assert fsdp2["stats"] == ddp["stats"]
        assert fsdp2["stats"]["skipped_steps"] == len(INJECT_AT)
        assert fsdp2["losses"] == pytest.approx(ddp["losses"], abs=1e-3)
        for name, values in ddp["parameters"].items():
            assert fsdp2["parameters"][name] == pytest.approx(values, abs=1e-3), name
    assert ranks[0][case]["fsdp2"]["parameters"] == ranks[1][case]["fsdp2"]["parameters"], "the ranks diverged"
    assert ranks[0][case]["fsdp2"]["stats"] == ranks[1][case]["fsdp2"]["stats"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["16-mixed:O1", "bf16-mixed:O2"])
def test_fsdp2_telemetry_reports_what_ddp_reports(compared, case):
    """The loss scale, the skip counter, the gradient norm (over all shards) and the sentinel's shares and headroom
    logged under FSDP2 are DDP's."""
    out, _ = compared
    name = case.replace(":", "-")
    ddp, fsdp2 = (read_events(out / "tb" / f"{name}-{strategy}") for strategy in ("ddp", "fsdp2"))
    for tag in ("precision/loss_scale", "precision/skipped_steps_total", *SENTINEL_TAGS):
        assert scalars(fsdp2, tag) == pytest.approx(scalars(ddp, tag), rel=1e-6), tag
    # DDP's rank zero logs its own finite norm on a skipped step; over all shards that step's norm is inf and is not
    # logged. Every other step's norm is the same.
    fsdp2_norms = scalars(fsdp2, "precision/grad_norm")
    assert len(fsdp2_norms) == 8 - len(INJECT_AT)
    ddp_norms = scalars(ddp, "precision/grad_norm")
    assert fsdp2_norms == pytest.approx({step: ddp_norms[step] for step in fsdp2_norms}, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["sharded", "full"])
def test_fsdp2_resumes_exactly_from_sharded_and_full_checkpoints(resumed, layout):
    """A run resumed at step 4 from a sharded or a full checkpoint continues as if never stopped: same losses, same
    scaler state and counters (the skip at step 2, before the checkpoint, included)."""
    for rank in resumed:
        uninterrupted, again = rank["16-mixed:O1"]["fsdp2"], rank["16-mixed:O1"]["resumed"][layout]
        assert again["losses"] == uninterrupted["losses"][4:]
        assert again["stats"] == uninterrupted["stats"]
        assert again["scaler_state"] == uninterrupted["scaler_state"]
        assert again["parameters"] == uninterrupted["parameters"]
        assert rank["bf16-mixed:O2"]["resumed"][layout]["stats"] == rank["bf16-mixed:O2"]["fsdp2"]["stats"]


@pytest.mark.slow
def test_fsdp2_lean_exact_is_fsdp2_o2_bit_for_bit_through_skips_and_a_resume(tmp_path):
    """lean-exact on a sharded model keeps FSDP2's fp32 shards as its exact masters: every loss, counter and weight
    (gathered whole) is O2's under FSDP2, bit for bit, on both ranks, also resumed at step 4 from a sharded and a
    full checkpoint; under DDP the same pair is bitwise equal too."""
    if fsdp2_sums_over_gloo():
        pytest.skip(FSDP2_SUMS_OVER_GLOO_REASON)
    ranks = _fsdp2_reports(tmp_path, "--cases", "bf16-mixed:O2,bf16-mixed:lean-exact", "--resume-at", "4")
    for rank in ranks:
        o2, exact = rank["bf16-mixed:O2"], rank["bf16-mixed:lean-exact"]
        for strategy in ("ddp", "fsdp2"):
            assert exact[strategy] == o2[strategy], strategy
        assert exact["fsdp2"]["stats"]["skipped_steps"] == len(INJECT_AT)
        assert exact["resumed"] == o2["resumed"]
        assert exact["resumed"]["sharded"]["parameters"] == exact["fsdp2"]["parameters"]
    first, second = (rank["bf16-mixed:lean-exact"]["fsdp2"] for rank in ranks)
    assert (first["parameters"], first["stats"]) == (second["parameters"], second["stats"]), "the ranks diverged"


def test_fsdp2_policy_of_lean_exact_gathers_bf16_from_its_fp32_shards():
    """lean-exact's FSDP2 policy is O2's in bf16: the fp32 shards are the masters, gathered and reduced in bf16."""
    policy = MixedPrecision("bf16-mixed", opt_level="lean-exact").fsdp2_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.bfloat16)


@pytest.mark.slow
def test_fsdp2_peak_memory_per_rank_is_at_most_0_6_of_ddps(resumed):
    """Each rank's peak tensor bytes in a training step under FSDP2 are at most 0.6x those of the same run under DDP.

    The peak is read from the profiler's allocator events (``tests.helpers.peak_step_bytes``): DDP's exactly; FSDP2's
    as the bytes held at the step's start plus the profiler's rise inside the step, since gloo frees some of FSDP2's
    buffers in threads the profiler does not record.
    """
    for rank in resumed:
        for case in ("16-mixed:O1", "bf16-mixed:O2"):
            memory = rank[case]["memory"]
            assert memory["fsdp2"] <= 0.6 * memory["ddp"], memory


def test_profiler_reports_a_storage_resized_to_zero_as_freed():
    """The profiler's allocator events see a storage freed by ``resize_(0)``, as FSDP2 frees its gathered parameters,
    which the peak measure relies on."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        gathered = torch.empty(1000)
        gathered.untyped_storage().resize_(0)
        gathered.untyped_storage().resize_(2000)
        gathered.untyped_storage().resize_(0)
    events = profiler.profiler.kineto_results.events()
    assert [event.nbytes() for event in events if event.name() == "[memory]"] == [4000, -4000, 2000, -2000]


@pytest.mark.slow
def test_fsdp2_host_syncs_per_step_are_no_more_than_lightnings(resumed):
    """Host syncs per step under FSDP2 are at most Lightning's own bf16-mixed there (Lightning refuses 16-mixed under
    ModelParallelStrategy; fp16 reads the skip flag once, as torch's ShardedGradScaler does)."""
    for rank in resumed:
        bf16 = rank["bf16-mixed:O2"]["syncs"]
        assert max(bf16["plugin"]) <= min(bf16["lightning"])
        fp16 = rank["16-mixed:O1"]["syncs"]
        assert max(fp16["plugin"]) <= min(fp16["lightning"]) + 1


@pytest.mark.slow
def test_fsdp2_refuses_half_weight_levels_and_o2_without_fsdp2s_policy(resumed):
    """O3 and lean are refused on a sharded model, and O2 without mp_policy or with a keep_fp32 module gathered in
    half, each by name with the alternative."""
    for rank in resumed:
        refused = rank["refusals"]
        assert "opt_level='O3'" in refused["16-mixed:O3"] and "opt_level='O2'" in refused["16-mixed:O3"]
        assert "opt_level='lean'" in refused["bf16-mixed:lean"]
        assert "mp_policy=plugin.fsdp2_policy()" in refused["16-mixed:O2 without mp_policy"]
        assert "'first'" in refused["16-mixed:O2 without mp_policy"]
        kept = refused["bf16-mixed:O2 keep_fp32 without its own policy"]
        assert "a keep_fp32 module, 'second'" in kept and "fsdp2_policy(keep_fp32=True)" in kept


@pytest.mark.slow
def test_fsdp2_o2_keeps_a_module_fp32_with_its_own_fully_shard_policy(resumed):
    """O2 with keep_fp32=['second'], that module sharded with plugin.fsdp2_policy(keep_fp32=True): it trains, skips
    the planted steps and leaves the ranks identical."""
    for rank in resumed:
        assert rank["keep_fp32"]["stats"]["skipped_steps"] == len(INJECT_AT)
    assert resumed[0]["keep_fp32"]["parameters"] == resumed[1]["keep_fp32"]["parameters"]


@pytest.mark.parametrize(
    ("precision", "opt_level", "param_dtype", "reduce_dtype"),
    [
        ("16-mixed", "O2", torch.float16, torch.float16),
        ("bf16-mixed", "O2", torch.bfloat16, torch.bfloat16),
        ("16-mixed", "O1", None, None),
        ("32-true", "O0", None, None),
    ],
)
def test_fsdp2_policy_maps_the_opt_level(precision, opt_level, param_dtype, reduce_dtype):
    """plugin.fsdp2_policy() is the MixedPrecisionPolicy that carries out the opt level under FSDP2."""
    policy = MixedPrecision(precision, opt_level=opt_level).fsdp2_policy()
    assert isinstance(policy, MixedPrecisionPolicy)
    assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, reduce_dtype)


def test_fsdp2_policy_of_a_keep_fp32_subtree_is_fp32():
    """A keep_fp32 subtree's own fully_shard call gets an fp32 policy, whatever the opt level."""
    policy = MixedPrecision("bf16-mixed", opt_level="O2", keep_fp32=["head"]).fsdp2_policy(keep_fp32=True)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.float32, torch.float32)


def test_fsdp2_policy_needs_a_resolved_precision():
    """precision='auto' is chosen at setup, after configure_model: fsdp2_policy() says so instead of guessing."""
    with pytest.raises(ValueError, match="precision='auto'"):
        MixedPrecision("auto").fsdp2_policy()


@pytest.mark.slow
def test_fabric_fsdp2_skips_an_inf_on_one_rank_refuses_o2_and_trains_o3_sharded_after_setup(tmp_path):
    """Fabric's ModelParallelStrategy (fp16 O1, layers sharded with plugin.fsdp2_policy()): an inf in rank 1's shard
    is skipped by both ranks, the weights stay identical, the plugin's state resumes from the sharded checkpoint; O2
    on a model sharded after fabric.setup is refused at the first forward with the recipe; O3 trains its fp16 weights
    as FSDP2's shards, identical on both ranks."""
    arguments = ["--out", str(tmp_path), "--strategy", "fsdp2", "--inject-rank", "1", "--inject-at", "2,5"]
    run(arguments, timeout=90, script=FABRIC_SCRIPT)
    ranks = reports(tmp_path)
    assert ranks[0]["steps"] == ranks[1]["steps"]
    assert [step for step, _, skipped in ranks[0]["steps"] if skipped] == list(INJECT_AT)
    assert ranks[0]["stats"] == ranks[1]["stats"] and ranks[0]["stats"]["precision/skipped_steps"] == 2.0
    assert len({checksum for rank in ranks for checksum in rank["checksums"]}) == 1, "the ranks diverged"
    assert [rank["local_overflows"] for rank in ranks] == [0, 2]
    assert all(rank["resumed_stats"] == rank["stats"] for rank in ranks)
    assert all("shard the model before fabric.setup" in rank["o2_refusal"].lower() for rank in ranks)
    o3_runs = [rank["o3_sharded_after_setup"] for rank in ranks]
    assert all(o3["sharded"] and o3["shard_dtypes"] == ["torch.float16"] for o3 in o3_runs)
    assert all(o3["trained"] and o3["optimizer_steps"] == 3 for o3 in o3_runs)
    assert len({checksum for o3 in o3_runs for checksum in o3["checksums"]}) == 1, "the O3 ranks diverged"


@pytest.mark.parametrize("opt_level", ["lean", "lean-kahan"])
def test_fabric_lean_sharded_after_setup_is_refused_at_the_first_forward(single_process_group, opt_level):
    """lean on a model that Fabric's parallelize_fn shards after fabric.setup is refused before any step, naming O3."""
    plugin = MixedPrecision("bf16-mixed", opt_level=opt_level)

    def shard(module: nn.Module, device_mesh: Any) -> nn.Module:
        return fully_shard(module, mesh=device_mesh["data_parallel"], mp_policy=plugin.fsdp2_policy())

    strategy = ModelParallelStrategy(parallelize_fn=shard, data_parallel_size=1, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, plugins=[plugin])
    fabric.launch()
    model = fabric.setup_module(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    with pytest.raises(ShardedPrecisionError, match=rf"opt_level='{opt_level}'.*Use opt_level='O3'"):
        model(torch.randn(4, 8))


@pytest.mark.parametrize("norm_has_its_own_group", [True, False])
def test_fabric_o3_sharded_after_setup_needs_its_fp32_norms_in_groups_of_their_own(
    single_process_group, norm_has_its_own_group
):
    """O3 sharded in parallelize_fn trains with its norm fp32 in its own group; a group mixing dtypes is refused."""
    plugin = MixedPrecision("bf16-mixed", opt_level="O3")

    def shard(module: nn.Module, device_mesh: Any) -> nn.Module:
        if norm_has_its_own_group:
            fully_shard(module[1], mesh=device_mesh["data_parallel"], mp_policy=plugin.fsdp2_policy(keep_fp32=True))
        return fully_shard(module, mesh=device_mesh["data_parallel"], mp_policy=plugin.fsdp2_policy())

    strategy = ModelParallelStrategy(parallelize_fn=shard, data_parallel_size=1, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, plugins=[plugin])
    fabric.launch()
    network = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
    model = fabric.setup_module(network)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(network.parameters(), lr=0.05))
    x = torch.randn(4, 8)
    if not norm_has_its_own_group:
        with pytest.raises(
            ShardedPrecisionError, match=r"group '<root>' holds half weights and the fp32 weights of \['1'\]"
        ):
            model(x)
        return
    weights = [layer.weight for layer in network]  # the bias before the norm gets no gradient: the norm removes it
    initial = [weight.full_tensor().clone() for weight in weights]
    fabric.backward(model(x).float().square().mean())
    optimizer.step()
    assert [parameter.dtype for parameter in network[1].parameters()] == [torch.float32, torch.float32]
    assert {parameter.dtype for parameter in (*network[0].parameters(), *network[2].parameters())} == {torch.bfloat16}
    assert all(not torch.equal(before, after.full_tensor()) for before, after in zip(initial, weights, strict=True))
