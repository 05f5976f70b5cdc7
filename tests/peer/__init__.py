"""Peer check: Pyro's own tests run with this package's ELBOs (see run_pyro_tests.py)."""
