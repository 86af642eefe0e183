"""The cases of `pdserve bench abuse`, in the order they run: (row name, case)."""

from __future__ import annotations

from pdserve.bench.abuse_caches import corrupt_gguf_cache, corrupt_quant_cache
from pdserve.bench.abuse_http import (
    abandoned_streams,
    allowed_json_of_lists,
    allowed_stop_strings,
    big_json_of_lists,
    deep_json,
    huge_body,
    huge_integer,
    huge_prompt,
    idle_sockets,
    long_stop_strings,
    many_generations,
    one_client_floods,
    respelled_keys_flood,
    slow_body,
    slowloris,
    stalled_big_bodies,
)
from pdserve.bench.abuse_routes import (
    disconnect_storm,
    invalid_messages,
    largest_tokenize_flood,
    million_ids_detokenize,
    tokenize_over_the_cap,
)
from pdserve.bench.abuse_store import metadata_of_many_keys, one_key_fills_the_store, text_of_empty_lists
from pdserve.bench.abuse_target import Case
from pdserve.bench.abuse_workers import (
    heavy_grammar,
    killed_worker_weight_update,
    lone_surrogates,
    long_rid,
    overflowing_values,
    raw_worker_connects,
    server_info_secrets,
    stopped_prefill,
    tiny_temperature,
)

CASES: list[tuple[str, Case]] = [
    ("3M-character prompt", huge_prompt),
    ("400 prompts x n = 128 (16 KB body)", many_generations),
    ("33 MiB body", huge_body),
    ("31 MiB of empty lists", big_json_of_lists),
    ("4 MiB of empty lists (allowed)", allowed_json_of_lists),
    ("100k-deep JSON", deep_json),
    ("5,000-digit integer", huge_integer),
    ("16 stop strings of 100k characters", long_stop_strings),
    ("16 stop strings of 1,024 characters (allowed)", allowed_stop_strings),
    ("body stalls after 10 bytes", slow_body),
    ("24 bodies of 3.9 MiB stalled after 1 MiB", stalled_big_bodies),
    ("300 idle connections", idle_sockets),
    ("50 connections trickling headers", slowloris),
    ("one client, 40 requests at once", one_client_floods),
    ("one key spelled 8 ways, 40 requests at once", respelled_keys_flood),
    ("6 streams dropped after one chunk", abandoned_streams),
    ("info endpoints read with the inference key", server_info_secrets),
    ("10 of the largest /tokenize with token strings, one key", largest_tokenize_flood),
    ("/detokenize of 1M ids", million_ids_detokenize),
    ("/tokenize over the cap", tokenize_over_the_cap),
    ("24 clients leave mid-prompt", disconnect_storm),
    ("/v1/messages: 6 conversations Anthropic refuses, a wrong key", invalid_messages),
    ("one key stores 13 responses of 3.9 MiB: another key's survives", one_key_fills_the_store),
    ("responses whose text holds 1.3M empty lists", text_of_empty_lists),
    ("metadata of 250k keys", metadata_of_many_keys),
    ("top_k 2**63; seed 2**63-1 with n 2; stop_token_ids [2**63]", overflowing_values),
    ("rid of 1 MiB with n = 128", long_rid),
    ("lone surrogate in stop, rid, prompt", lone_surrogates),
    ("temperature 1e-38", tiny_temperature),
    ("EBNF of 30k alternatives", heavy_grammar),
    ("SIGSTOP the prefill for 3.5 s mid-prefill", stopped_prefill),
    ("300 raw connects to each worker port", raw_worker_connects),
]
# Last, apart: it replaces a worker on purpose (the row's "workers kept" is then expected to be "no").
DESTRUCTIVE: list[tuple[str, Case]] = [
    ("1 MiB of random bytes in the quantized-weights cache, then kill -9 the decode", corrupt_quant_cache),
    (
        "1 MiB of random bytes in the GGUF model's cached tokenizer, then kill -9 the decode",
        corrupt_gguf_cache,
    ),
    ("kill -9 the decode, then a weight update", killed_worker_weight_update),
]
