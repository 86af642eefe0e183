"""KV transfer throughput: pdserve.kv_transfer through shared memory and over loopback gloo, side by side,
and a plain TCP socket between the same processes.

Geometry of the bundled model's KV (30 layers, 3 kv heads, head_dim 64, fp32, page size 16). For each
prompt length: the KV path's time runs from `sender.send()` (the decode's page list already delivered)
to `receiver.poll()` reporting SUCCESS, gather and scatter included; the raw path sends the same number
of bytes from one contiguous buffer with sendall/recv_into. Each size runs twice: with scattered page
ids (staged copies) and with consecutive ones (pool to pool). Both processes live on one host, so their
time.monotonic() clocks agree. Each transport (--transports) runs in its own pair of processes: `dist`
over the gloo pair group, `shm` with the prefill's pool in shared memory, copied by the decode
(kv_transfer/shm.py); the ratio column is shm over dist throughput.

`--prefill-tp P --decode-tp D` give each side the pools of a TP worker's ranks, each its KV heads
(kv_transfer/layout.py kv_head_ranges; `--kv-heads` for a model other than the bundled one's 3): over
shared memory each decode rank's pool takes its heads straight from the prefill rank's segment holding
them; over the pair group the prefill's rank 0 gathers every head into its full-head pool per room and
the decode scatters them out to its ranks after the room lands (both inside the timed span, as in a
worker, where the ranks' pools are shared with rank 0).

    python -P -m pdserve.bench.bench_transfer [--tokens 1024 4096 16384] [--reps 3] [--transports dist shm]
        [--prefill-tp 1 --decode-tp 3 --kv-heads 3] [--kv-checksum off sample all]

`--kv-checksum` runs each mode in its own pair of processes (default: off only) and prints what each
mode adds to a hand-off's time against `off` on the same transport.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

import torch

from pdserve.config import KV_CHECKSUMS
from pdserve.kv_transfer import KVReceiver, KVSender, TransferConfig, TransferState
from pdserve.kv_transfer.checksum import checked_indices, page_hashes
from pdserve.kv_transfer.layout import describe_split, kv_head_ranges, mapping_error
from pdserve.kv_transfer.shm import copy_heads, shared_pool
from pdserve.protocol.kv_trailer import FirstToken

LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 30, 3, 64, 16


def _fingerprint(kv_heads: int) -> dict[str, str | int]:
    return {
        "architecture": "LlamaForCausalLM",
        "num_layers": LAYERS,
        "kv_heads": kv_heads,
        "head_dim": HEAD_DIM,
        "dtype": "float32",
        "page_size": PAGE_SIZE,
        "weights_hash": "bench",
    }


def _pool(num_pages: int, kv_heads: int) -> torch.Tensor:
    return torch.randn(num_pages, LAYERS, 2, PAGE_SIZE, kv_heads, HEAD_DIM)  # [N, L, 2, P, H, D]


def _prefill(conn, num_pages: int, config: TransferConfig, tp: int, kv_heads: int) -> None:
    torch.set_num_threads(1)
    kv = _pool(num_pages, kv_heads)
    fp = _fingerprint(kv_heads)
    if tp == 1:
        segment = None
        if config.transport != "dist":
            segment, kv = shared_pool(kv)
        sender = KVSender(kv, fp, "127.0.0.1", 0, config, segment=segment)
        segments = []
    else:  # a TP worker's rank 0: every rank's pool in its segment, the full-head pool for the pair group
        heads = kv_head_ranges(kv_heads, tp)
        parts = [kv[:, :, :, :, h.start : h.stop].contiguous() for h in heads]
        segments, pools = [], []
        for part in parts:
            seg, pool = shared_pool(part)
            segments.append(seg)
            pools.append(pool)
        every = [range(kv_heads)]

        def gather(pages: list[int]) -> None:
            copy_heads(pools, heads, pages, [kv], every, pages)

        sender = KVSender(kv, fp, "127.0.0.1", 0, config, tp_size=tp, rank_segments=segments, prepare=gather)
    sender.start()
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send((sender.addr, listener.getsockname()[1]))
    raw, _ = listener.accept()
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    flat = kv.view(-1).view(torch.uint8).numpy()  # raw source: the pool's own bytes, contiguous
    while True:
        cmd = conn.recv()
        if cmd[0] == "send":
            _, room, pages, num_tokens = cmd
            t_send = time.monotonic()
            sender.send(room, pages, num_tokens, FirstToken(first_token=1))
            conn.send(t_send)
            while not sender.poll():
                time.sleep(0.001)
        elif cmd[0] == "raw":
            nbytes = cmd[1]
            t0 = time.monotonic()
            raw.sendall(memoryview(flat)[:nbytes])
            raw.recv(1)  # receiver's ack: everything arrived
            conn.send(t0)
        else:
            break
    raw.close()
    sender.close()
    for seg in segments:
        seg.close()


def _decode(
    conn, num_pages: int, config: TransferConfig, prefill_addr: str, raw_port: int, tp: int, kv_heads: int
) -> None:
    torch.set_num_threads(1)
    kv = _pool(num_pages, kv_heads)
    heads = kv_head_ranges(kv_heads, tp)
    pools = None if tp == 1 else [torch.zeros(*kv.shape[:4], len(h), HEAD_DIM) for h in heads]
    receiver = KVReceiver(kv, _fingerprint(kv_heads), config, tp_size=tp, rank_pools=pools)
    receiver.start()
    receiver.connect(prefill_addr)
    raw = socket.create_connection(("127.0.0.1", raw_port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sink = memoryview(kv.view(-1).view(torch.uint8).numpy())
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] == "request":
            _, room, pages, num_tokens = cmd
            receiver.request(room, prefill_addr, pages, num_tokens)
            while receiver.state(room) != TransferState.WAITING_FOR_INPUT:
                time.sleep(0.001)
            time.sleep(0.05)  # the page list reaches the prefill node before send() is timed
            conn.send("waiting")
            results = receiver.poll()
            while not results:
                time.sleep(0.0002)  # a worker's loop polls between steps; never spin on the GIL
                results = receiver.poll()
            assert results[0].state == TransferState.SUCCESS, results[0]
            if pools is not None and not results[0].shm:  # the decode worker's scatter to its ranks
                copy_heads([kv], [range(kv_heads)], pages, pools, heads, pages)
            t_done = time.monotonic()
            conn.send((t_done, results[0].num_bytes, results[0].shm))
        elif cmd[0] == "raw":
            nbytes, got = cmd[1], 0
            while got < nbytes:
                got += raw.recv_into(sink[got:nbytes])
            t1 = time.monotonic()
            raw.sendall(b"k")
            conn.send(t1)
        else:
            break
    raw.close()
    receiver.close()


def _run(
    transport: str, checksum: str, args: argparse.Namespace
) -> dict[tuple[int, str], tuple[float, float, float]]:
    """One pair of processes on `transport` with KV checksums `checksum`: (tokens, order) -> (kv seconds,
    raw seconds, raw/kv ratio)."""
    max_pages = -(-max(args.tokens) // PAGE_SIZE)
    config = TransferConfig(
        backend="gloo",
        transport=transport,
        waiting_timeout_s=120,
        transfer_timeout_s=120,
        chunk_bytes=args.chunk_mib << 20,
        kv_checksum=checksum,
    )
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    tp = (args.prefill_tp, args.kv_heads)
    prefill = ctx.Process(target=_prefill, args=(p_child, max_pages, config, *tp), daemon=True)
    prefill.start()
    prefill_addr, raw_port = p_conn.recv()
    decode = ctx.Process(
        target=_decode,
        args=(d_child, max_pages, config, prefill_addr, raw_port, args.decode_tp, args.kv_heads),
        daemon=True,
    )
    decode.start()
    assert d_conn.recv() == "ready"
    page_bytes = LAYERS * 2 * PAGE_SIZE * args.kv_heads * HEAD_DIM * 4
    out = {}
    seq = 0
    for tokens, order in [(t, o) for t in args.tokens for o in ("random", "runs")]:
        n_pages = -(-tokens // PAGE_SIZE)
        nbytes = n_pages * page_bytes
        kv_times, raw_times = [], []
        for rep in range(args.reps + 1):  # the first round warms up pair group, buffers and page faults
            seq += 1
            room = f"bench-{seq}"
            if order == "random":
                src = torch.randperm(max_pages)[:n_pages].tolist()
                dst = torch.randperm(max_pages)[:n_pages].tolist()
            else:
                src, dst = list(range(n_pages)), list(range(max_pages - n_pages, max_pages))
            d_conn.send(("request", room, dst, tokens))
            assert d_conn.recv() == "waiting"
            p_conn.send(("send", room, src, tokens))
            t_send = p_conn.recv()
            t_done, got_bytes, via_shm = d_conn.recv()
            assert got_bytes >= nbytes, (got_bytes, nbytes)  # more where decode ranks share heads
            assert via_shm == (transport != "dist"), f"{transport}: the transfer went the other way"
            d_conn.send(("raw", nbytes))
            p_conn.send(("raw", nbytes))
            t1, t0 = d_conn.recv(), p_conn.recv()
            if rep > 0:
                kv_times.append(t_done - t_send)
                raw_times.append(t1 - t0)
        # Ratio per round (KV and raw run back to back, under the same machine load), then the median.
        ratio = statistics.median(r / k for k, r in zip(kv_times, raw_times))
        out[(tokens, order)] = (statistics.median(kv_times), statistics.median(raw_times), ratio)
    for conn in (p_conn, d_conn):
        conn.send(("exit",))
    prefill.join(timeout=30)
    decode.join(timeout=30)
    return out


def _hash_seconds(n_pages: int, mode: str, kv_heads: int, reps: int) -> float:
    """Median seconds to hash a room's pages as `mode` picks them (kv_transfer/checksum.py), in this
    process, each round on pages of a pool 4x the room's that the previous rounds did not touch."""
    kv = _pool(4 * n_pages, kv_heads)
    indices = checked_indices(n_pages, mode)
    times = []
    for rep in range(max(reps, 4)):
        start = (rep % 4) * n_pages
        t0 = time.perf_counter()
        page_hashes(kv, list(range(start, start + n_pages)), indices)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--chunk-mib", type=int, default=TransferConfig().chunk_bytes >> 20)
    parser.add_argument("--transports", nargs="+", choices=["dist", "shm"], default=["dist", "shm"])
    parser.add_argument("--prefill-tp", type=int, default=1, help="the prefill worker's TP size")
    parser.add_argument("--decode-tp", type=int, default=1, help="the decode worker's TP size")
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS, help="the model's KV heads")
    parser.add_argument(
        "--kv-checksum",
        nargs="+",
        choices=KV_CHECKSUMS,
        default=["off"],
        help="checksum modes to run, each in its own pair of processes (kv_transfer/checksum.py)",
    )
    args = parser.parse_args(argv)
    error = mapping_error(args.kv_heads, args.prefill_tp, args.decode_tp)
    if error is not None:
        parser.error(error)

    page_bytes = LAYERS * 2 * PAGE_SIZE * args.kv_heads * HEAD_DIM * 4
    print(f"KV geometry: {LAYERS} layers x {args.kv_heads} kv heads x head_dim {HEAD_DIM}, fp32, page {PAGE_SIZE} tokens "
          f"= {page_bytes / 2**10:.0f} KiB/page; chunk {args.chunk_mib} MiB; torch threads 1 per process")  # fmt: skip
    if (args.prefill_tp, args.decode_tp) != (1, 1):
        p_split, d_split = (describe_split(args.kv_heads, n) for n in (args.prefill_tp, args.decode_tp))
        shares = [len(h) / args.kv_heads for h in kv_head_ranges(args.kv_heads, args.decode_tp)]
        print(f"prefill {p_split} -> decode {d_split}: each decode rank receives "
              + " | ".join(f"{s:.0%}" for s in shares) + " of a page's bytes (MiB column: all ranks)")  # fmt: skip
    print("medians over rounds; GB/s from send->success = sender.send() called to receiver.poll() reporting")
    print(
        "SUCCESS (page list already at the prefill node); dist = loopback gloo pair group, shm = shared memory"
    )
    print(
        "(the decode copies out of the prefill's pool); raw = a plain TCP socket between the dist processes;"
    )
    print("shm/dist = throughput ratio. pages: random = scattered page ids on both sides; runs = consecutive")
    print("page ids, as a fresh allocator hands them out")
    runs = [(t, c) for t in args.transports for c in args.kv_checksum]
    results = {run: _run(*run, args) for run in runs}
    names = {run: run[0] if len(args.kv_checksum) == 1 else "/".join(run) for run in runs}
    cols = "".join(f" {names[r] + ' GB/s':>17} {names[r] + ' ms':>15}" for r in runs)
    first = args.kv_checksum[0]
    ratio = {"dist", "shm"} <= set(args.transports)
    ratio_col = f" {'shm/dist':>8}" if ratio else ""
    print(f"{'tokens':>7} {'pages':>7} {'MiB':>8}{cols}{ratio_col} {'raw GB/s':>9}")
    for tokens, order in [(t, o) for t in args.tokens for o in ("random", "runs")]:
        nbytes = -(-tokens // PAGE_SIZE) * page_bytes
        line = f"{tokens:>7} {order:>7} {nbytes / 2**20:>8.1f}"
        for r in runs:
            kv_s = results[r][(tokens, order)][0]
            line += f" {nbytes / kv_s / 1e9:>17.2f} {kv_s * 1e3:>15.1f}"
        if ratio:
            shm_over_dist = (
                results[("dist", first)][(tokens, order)][0] / results[("shm", first)][(tokens, order)][0]
            )
            line += f" {shm_over_dist:>8.2f}"
        raw_s = next(iter(results.values()))[(tokens, order)][1]
        print(line + f" {nbytes / raw_s / 1e9:>9.2f}")
    for c in [
        c for c in args.kv_checksum if c != "off"
    ]:  # the hashing alone: steadier than two runs' difference
        tokens = max(args.tokens)
        per_side = _hash_seconds(-(-tokens // PAGE_SIZE), c, args.kv_heads, args.reps)
        shares = ", ".join(
            f"{t} {2 * per_side / results[(t, args.kv_checksum[0])][(tokens, 'runs')][0]:.1%}"
            for t in args.transports
        )
        print(f"checksum {c} at {tokens} tokens: {per_side * 1e3:.2f} ms of hashing a side, both sides against "
              f"a {args.kv_checksum[0]} hand-off of consecutive pages: {shares}")  # fmt: skip
    if "off" in args.kv_checksum:  # what each mode adds to a hand-off, against no checksum on its transport
        for t, c in [r for r in runs if r[1] != "off"]:
            costs = [
                f"{tokens} {order} {results[(t, c)][(tokens, order)][0] / results[(t, 'off')][(tokens, order)][0] - 1:+.1%}"
                for tokens in args.tokens
                for order in ("random", "runs")
            ]
            print(f"checksum {c} on {t}, time against off: " + ", ".join(costs))


if __name__ == "__main__":
    main()
