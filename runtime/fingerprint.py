"""A worker's compatibility record: what a gateway and a KV peer compare before they pair two nodes
(pdserve/protocol/compat.py says what each field means and which may differ between two nodes)."""

from __future__ import annotations

from pdserve.config import RuntimeConfig
from pdserve.kv_transfer.layout import KV_LAYOUT, describe_split
from pdserve.protocol.codec import PROTOCOL_VERSION
from pdserve.runtime.kv_pool import KVGeometry
from pdserve.runtime.loader import LoadedModel


def fingerprint(
    cfg: RuntimeConfig, loaded: LoadedModel, geometry: KVGeometry, attention_backend: str, tp_size: int
) -> dict[str, str | int]:
    """The record of a worker running `loaded` over a pool of `geometry` (rank 0's heads) at `tp_size`."""
    g, spec = geometry, loaded.spec
    speculative = (
        "none"
        if cfg.speculative_algorithm is None
        else f"{cfg.speculative_algorithm}/{cfg.speculative_num_draft_tokens}"
    )
    return {
        "architecture": spec.architecture,
        "num_layers": g.num_layers,
        "kv_heads": spec.num_kv_heads,  # the wire carries every head, whatever the TP sizes
        "head_dim": g.head_dim,
        "weights_hash": loaded.weights_hash,
        "weights_dtype": str(loaded.dtype).removeprefix("torch."),
        "quantization": loaded.quantization,
        "kv_dtype": str(g.dtype).removeprefix("torch."),
        "page_size": g.page_size,
        "kv_layout": KV_LAYOUT,
        # a batch-invariant pair computes a prompt's KV as its decode steps would: both sides or neither
        "batch_invariant": int(loaded.batch_invariant),
        **loaded.tokenizer_hashes,
        "protocol": PROTOCOL_VERSION,
        "attention_backend": attention_backend,
        "speculative": speculative,
        "kv_heads_split": describe_split(spec.num_kv_heads, tp_size),
    }
