"""The type of a JSON object as Python holds it once parsed (`json.loads`) or before it is dumped: an
HTTP body, a reply, a stored response. One alias, so every module means the same thing by it."""

from __future__ import annotations

from typing import Any

Json = dict[str, Any]
