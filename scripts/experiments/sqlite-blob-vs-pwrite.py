#!/usr/bin/env python3
"""Why the local store keeps object data out of SQLite: 1 MiB writes as SQLite blobs (WAL mode,
synchronous=NORMAL, the checkpoint and a final sync included) against pwrite of the same bytes
to a file (a final fsync included), in one run on the same disk.

Usage: scripts/experiments/sqlite-blob-vs-pwrite.py [DIR]   (default: a temp dir under target/)
"""
import os
import sqlite3
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
base = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target")
os.makedirs(base, exist_ok=True)
N, SIZE = 200, 1 << 20
data = os.urandom(SIZE)
with tempfile.TemporaryDirectory(dir=base) as d:
    db = sqlite3.connect(os.path.join(d, "blob.db"))
    db.execute("pragma journal_mode=wal")
    db.execute("pragma synchronous=normal")
    db.execute("create table t (k integer primary key, v blob)")
    start = time.time()
    for batch in range(0, N, 8):
        with db:
            for i in range(batch, batch + 8):
                db.execute("insert or replace into t values (?, ?)", (i % 64, data))
    db.execute("pragma wal_checkpoint(truncate)")
    os.sync()
    sqlite_s = time.time() - start
    fd = os.open(os.path.join(d, "raw"), os.O_RDWR | os.O_CREAT)
    start = time.time()
    for i in range(N):
        os.pwrite(fd, data, (i % 64) * SIZE)
    os.fsync(fd)
    raw_s = time.time() - start
print(f"1 MiB writes x{N}: sqlite blobs {N * SIZE / sqlite_s / 1e6:.0f} MB/s, "
      f"pwrite {N * SIZE / raw_s / 1e6:.0f} MB/s, ratio {raw_s / sqlite_s:.2f}")
