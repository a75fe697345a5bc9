"""Tests of the opt level policies."""
