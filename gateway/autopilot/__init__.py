"""Loops that act on the cluster by themselves, from what finished requests show: canaries, a fixed request
per worker pair compared with the pair's first answer (`canary.py`), and the elastic controller, which moves
workers between prefill and decode as the load asks (`elastic.py`). They run generations and read their
traces, so they sit above `generation/`; the routes that show them are in `api/`.
"""
