"""Text in and out of the model: the tokenizer and chat template, incremental detokenizing and stop
strings, reasoning sections, tool calls (`function_call/`), a chat reply's parts (`chat_output.py`) and
structured-output constraints (`structured.py`). Pure text processing: it imports only the gateway's
shared modules (`errors.py`, `request_models.py`), never a room.
"""
