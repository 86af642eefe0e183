"""The compatibility record: what two nodes compare before they work together.

Every worker builds one record at start (runtime/runner.py `ModelRunner.fingerprint`) and sends it at
each handshake: registering with the gateway (`Register.fingerprint`: every worker of a cluster) and a
decode node's `Hello` to a prefill node (kv_transfer/handshake.py adds the pool's page geometry and the
transfer backend). Each field either must be equal on both sides or may differ, for the reason
`MAY_DIFFER` gives; a refusal names every differing field that must be equal.

Fields (flat, str or int values):
- architecture, num_layers, kv_heads, head_dim: the model's shape, hence the KV's;
- weights_hash, weights_dtype, quantization: the weights that computed the KV (a decode step on other
  weights reads KV it would not have written);
- kv_dtype, page_size, kv_layout: how the KV sits in a page, byte for byte;
- batch_invariant: a batch-invariant pair computes a prompt's KV as its decode steps would;
- tokenizer, chat_template: hashes of the tokenizer's files and of the chat template (token ids and
  grammars mean the same on both sides);
- protocol: the wire protocol's version (also checked on every frame, pdserve/protocol/codec.py);
- attention_backend, speculative, kv_heads_split: may differ (`MAY_DIFFER`).

What the record does not carry: the weight version, which moves at run time; each hand-off carries the
prefill's (FirstToken.weight_version), and the decode never caches KV of another version.
"""

from __future__ import annotations

from collections.abc import Mapping

Record = Mapping[str, str | int]

# Fields two nodes may disagree on, and why that is safe.
MAY_DIFFER: dict[str, str] = {
    "attention_backend": "every attention backend reads and writes the same KV layout (kv_layout)",
    "speculative": "drafts are the decode node's own; only the target model's KV travels",
    "kv_heads_split": "the wire carries every KV head; each side splits them over its TP ranks its own way",
}


def compare(local: Record, remote: Record) -> tuple[list[str], list[str]]:
    """(fields that must be equal and differ, fields that differ but may), each sorted."""
    refused: list[str] = []
    allowed: list[str] = []
    for key in sorted(set(local) | set(remote)):
        if local.get(key, "<missing>") != remote.get(key, "<missing>"):
            (allowed if key in MAY_DIFFER else refused).append(key)
    return refused, allowed


def describe(local: Record, remote: Record, keys: list[str], remote_name: str) -> str:
    """`key: local=... <remote_name>=...` for each of `keys`, joined."""
    return "; ".join(
        f"{k}: local={local.get(k, '<missing>')!r} {remote_name}={remote.get(k, '<missing>')!r}" for k in keys
    )


def allowed_note(local: Record, remote: Record, keys: list[str], remote_name: str) -> str:
    """Why a pair whose `keys` differ may still work together: for the log and the pair's record."""
    return "; ".join(f"{describe(local, remote, [k], remote_name)} (allowed: {MAY_DIFFER[k]})" for k in keys)
