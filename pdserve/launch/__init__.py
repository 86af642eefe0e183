"""Launching a cluster: `pdserve up` (up.py), the supervisor that keeps its children alive, and CPU sharing."""
