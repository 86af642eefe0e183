"""`pdserve plan`: measured profiles of this host (profile.py), a discrete-event simulator of a cluster
built from them (simulate.py), and the search for the prefill/decode split with the best goodput under
latency targets (cli.py)."""
