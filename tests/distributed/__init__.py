"""Tests under DDP, FSDP, FSDP2 and tensor parallelism (:mod:`lightning_mp.fsdp`), on gloo CPU processes."""
