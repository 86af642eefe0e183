"""The HTTP side: each API family's routes and replies (OpenAI chat and completions, Responses, Anthropic
Messages, SGLang's native routes, tokenizer, cluster and weight admin, `/dashboard`), the OpenAPI document,
and what every route passes through first: API keys (`auth.py`), connection limits (`connections.py`),
body reading and per-client admission (`request_body.py`, `serving.py`), and the app state handlers reach
(`state.py`). The top of the gateway's rooms: it may import every other room, and none imports it.
"""
