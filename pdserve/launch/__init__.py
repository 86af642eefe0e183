"""Launching a cluster: the flag table every pdserve program parses (flags.py), `pdserve up` (up.py), the
supervisor that keeps its children alive, and CPU sharing."""
