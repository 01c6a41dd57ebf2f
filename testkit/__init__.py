"""Test-side helpers shared by tests/ and scripts/: not part of the package a fork copies.

ranks      run a function on D local gloo ranks (multi-rank tests on one CPU)
reference  the independent float64 full-batch reference, gradient comparisons, communication counting
"""
