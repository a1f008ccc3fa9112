"""How fast each checksum a manifest may name verifies bytes, and whether threads add up.

Every chunk a recovery or ``autohet checkpoint verify`` reads is hashed as it is read
(checkpoint/inspect.py ``read_item``: blocks of ``READ_BLOCK`` bytes into the hash of the
algorithm its digest names, checkpoint/manifest.py ``HASHERS``). This hashes ``--mib`` MiB of
random bytes that way with each algorithm - on one thread, then on ``--threads`` threads at once
(each its own copy of the bytes): the aggregate rate grows with the threads only when the
library releases the GIL while it hashes (recovery's verifying threads count on it). The best of
``--repeats``; the 1-min load average is printed with each row (other processes take cores too).

    .venv/bin/python scripts/bench_checksums.py

prints a table (GB/s per algorithm and thread count) and writes bench-out/bench_checksums.json.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

from _bench import write_json
from megatron_autohet.checkpoint.inspect import READ_BLOCK
from megatron_autohet.checkpoint.manifest import HASHERS


def hash_blocks(data: memoryview, algorithm: str) -> str:
    digest = HASHERS[algorithm]()
    for start in range(0, len(data), READ_BLOCK):
        digest.update(data[start:start + READ_BLOCK])
    return digest.hexdigest()


def rate(buffers: list[memoryview], algorithm: str, repeats: int) -> float:
    """GB/s over all ``buffers``, each hashed on a thread of its own; the best of ``repeats``."""
    best = float("inf")
    with ThreadPoolExecutor(len(buffers)) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(hash_blocks, buffers, [algorithm] * len(buffers)))
            best = min(best, time.perf_counter() - start)
    return sum(len(b) for b in buffers) / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB hashed per thread")
    parser.add_argument("--threads", type=int, default=2, help="threads at once (2nd row)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="bench-out/bench_checksums.json")
    args = parser.parse_args()
    buffers = [memoryview(os.urandom(args.mib * 2**20)) for _ in range(args.threads)]
    rows = []
    print(f"{'algorithm':10} {'threads':>7} {'GB/s':>7} {'x 1 thread':>10}  load")
    for algorithm in HASHERS:
        one = rate(buffers[:1], algorithm, args.repeats)
        rows.append({"algorithm": algorithm, "threads": 1, "gb_per_s": one,
                     "load": os.getloadavg()[0]})
        many = rate(buffers, algorithm, args.repeats)
        rows.append({"algorithm": algorithm, "threads": args.threads, "gb_per_s": many,
                     "load": os.getloadavg()[0]})
        for row, speedup in ((rows[-2], 1.0), (rows[-1], many / one)):
            print(f"{algorithm:10} {row['threads']:>7} {row['gb_per_s']:>7.2f} {speedup:>10.2f}"
                  f"  {row['load']:.1f}")
    write_json({"mib_per_thread": args.mib, "read_block": READ_BLOCK, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
