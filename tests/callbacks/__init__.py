"""Tests of the TensorBoard callbacks and the precision sentinel."""
