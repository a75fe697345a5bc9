"""Unit tests of the scaler's inf-flag pool and iteration record (lightning_mp.scaling.inf_flags): CPU, milliseconds."""

import pickle

import torch

from lightning_mp.bench.counting import count_syncs_and_ops
from lightning_mp.scaling.inf_flags import InfFlagPool, IterationRecord

CPU = torch.device("cpu")


def test_a_flag_is_allocated_once_and_reused_every_iteration():
    """An optimizer gets the same preallocated flag each iteration: no allocation after the first."""
    pool = InfFlagPool()
    first = pool.zeroed_flag(0, CPU, IterationRecord())
    pool.next_iteration()
    again = pool.zeroed_flag(0, CPU, IterationRecord())
    assert again is first and len(pool) == 1


def test_a_flag_read_clean_is_reused_without_a_zeroing_op_and_a_set_one_is_zeroed():
    """A flag the host read as 0 is handed out as it is; one that may hold a 1 is zeroed first."""
    pool = InfFlagPool()
    record = IterationRecord()
    flag = pool.zeroed_flag(0, CPU, record)
    pool.mark_clean(record, {0: False})
    with count_syncs_and_ops() as clean:
        pool.zeroed_flag(0, CPU, IterationRecord())
    flag.fill_(1.0)
    with count_syncs_and_ops() as dirty:
        reused = pool.zeroed_flag(0, CPU, IterationRecord())
    assert (clean.ops, dirty.ops) == (0, 1) and reused.item() == 0.0


def test_a_record_notes_which_flags_an_optimizer_used():
    """The record lists each optimizer's flags, so that only the flags read clean are marked clean."""
    pool = InfFlagPool()
    record = IterationRecord()
    pool.zeroed_flag(0, CPU, record)
    pool.zeroed_flag(1, CPU, record)
    pool.mark_clean(record, {0: False, 1: True})
    assert record.flag_slots == {0: [(0, CPU, 0)], 1: [(1, CPU, 0)]}
    with count_syncs_and_ops() as counts:
        pool.zeroed_flag(0, CPU, IterationRecord())
        pool.zeroed_flag(1, CPU, IterationRecord())
    assert counts.ops == 1


def test_the_record_reads_norms_once_and_knows_when_the_host_has_every_verdict():
    """A check-mode step's norms are read on the host once; the record then rules on the host."""
    record = IterationRecord()
    record.norms[0] = torch.tensor([1.0, float("inf")])
    record.device_flags[1] = torch.zeros(())
    assert record.checked and not record.on_host
    assert record.verdict_from_norms(0) == 1.0
    record.host_flags[1] = 0.0
    assert record.on_host and record.read() == {0: True, 1: False}


def test_pickled_pools_and_records_start_empty():
    """Device flags, local overflow counts and an iteration in progress are never pickled."""
    pool = InfFlagPool()
    record = IterationRecord()
    pool.count_local_overflow(pool.zeroed_flag(0, CPU, record).fill_(1.0))
    record.stepped.add(0)
    pool_copy, record_copy = pickle.loads(pickle.dumps((pool, record)))
    assert len(pool_copy) == 0 and pool_copy.local_overflows is None
    assert not record_copy.stepped and not record_copy.flag_slots
