"""A request's generation and its legs: routing it to a prefill and a decode worker (`routing.py`), reading
its room's outputs (`room_reader.py`) into text and logprobs (`collector.py`), trying again on another pair
(`retries.py`), remembering requests that failed workers (`failed_requests.py`), and its trace and OTLP
spans once it ends (`request_trace.py`, `tracing.py`). `generation.py` drives them. Built on `cluster/`,
`text/` and `observe/`; no HTTP.
"""
