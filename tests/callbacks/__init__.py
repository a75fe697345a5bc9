"""Tests of the TensorBoard callbacks."""
