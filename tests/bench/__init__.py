"""Tests of the benchmarks (:mod:`lightning_mp.bench`) and the step counts they report."""
