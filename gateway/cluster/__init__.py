"""The control plane: the zmq socket to the workers (`control.py`), registration and who holds an id
(`registration.py`), heartbeats (`liveness.py`), the worker registry and routing policies (`workers.py`,
`prefix_index.py`), clock offsets (`clock.py`), a request's room and the answers routed to it (`rooms.py`,
`answers.py`), moving a worker between roles (`role_switch.py`) and live weight updates over every worker
(`weights.py`). Imports the configuration and `observe/`; knows nothing of a generation or of HTTP.
"""
