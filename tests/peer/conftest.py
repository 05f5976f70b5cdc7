# The peer check runs Pyro's test suite (minutes, needs a Pyro checkout): never collect
# it in the repository's own pytest run. Run it with `python tests/peer/run_pyro_tests.py`.
collect_ignore = ["run_pyro_tests.py", "gradroute_peer_plugin.py"]
