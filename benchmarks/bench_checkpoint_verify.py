"""Cost of verified checkpoints for one rank: checksum speed, and its share of a save and of a load.

1. Hash speed over an in-memory buffer: xxh3-64 (what ``hpc_tools.checkpoints.verify`` uses), and for the
   choice zlib.crc32 (stdlib) and crc32c / google-crc32c when installed.
2. One rank's checkpoint: ``--gb`` of fp32 tensors in ``--files`` shard files written with torch.save and fsync
   (what a save costs), then ``record_share`` (sizes + xxh3-64 of every file, what each rank adds at save), then
   torch.load of every file (a load), then ``verify_share`` with checksums and with sizes only (what each rank adds at
   resume). Files are read back from the page cache, as they are right after a save; a cold read (a resume on
   another node) is bound by the file system for the load and the checksum alike.

Every rank verifies its share in parallel, so the per-rank figures are the job's cost when shards are balanced.

    PYTHONPATH=. python benchmarks/bench_checkpoint_verify.py [--gb 1.0] [--files 8] [--dir /tmp] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hpc_tools.checkpoints import verify as cv  # noqa: E402


def best_of(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def hash_speeds(nbytes: int) -> dict[str, float]:
    """GB/s of each available checksum over one buffer (best of 3)."""
    import xxhash

    buf = os.urandom(nbytes)
    candidates = {"xxh3_64 (xxhash)": lambda: xxhash.xxh3_64_intdigest(buf), "zlib.crc32": lambda: zlib.crc32(buf)}
    try:
        import crc32c

        candidates["crc32c"] = lambda: crc32c.crc32c(buf)
    except ImportError:
        pass
    try:
        import google_crc32c

        candidates["google-crc32c"] = lambda: google_crc32c.value(buf)
    except ImportError:
        pass
    return {name: nbytes / best_of(fn) / 1e9 for name, fn in candidates.items()}


def checkpoint_costs(folder: Path, gb: float, files: int) -> dict[str, float]:
    import torch

    per_file = int(gb * 1e9 / files / 4)
    tensors = [torch.randn(per_file) for _ in range(files)]
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for i, t in enumerate(tensors):
        path = folder / f"__0_{i}.distcp"
        with open(path, "wb") as f:
            torch.save({"t": t}, f)
            f.flush()
            os.fsync(f.fileno())
    save_s = time.perf_counter() - t0
    total = sum(p.stat().st_size for p in folder.iterdir())
    record_s = best_of(lambda: cv.record_share(folder, 0, 1, checksum=True))
    meta = {"files": {"algorithm": cv.ALGORITHM, "world_size": 1,
                      "by_rank": {"0": cv.record_share(folder, 0, 1, checksum=True)}}}
    load_s = best_of(lambda: [torch.load(p, weights_only=True) for p in sorted(folder.iterdir())])
    verify_s = best_of(lambda: cv.verify_share(folder, meta, 0, 1, checksum=True))
    size_s = best_of(lambda: cv.verify_share(folder, meta, 0, 1, checksum=False))
    return {"bytes": total, "files": files, "save_s": save_s, "record_s": record_s, "load_s": load_s,
            "verify_checksum_s": verify_s, "verify_size_s": size_s,
            "checksum_gb_per_s_per_rank": total / verify_s / 1e9,
            "record_pct_of_save": 100 * record_s / save_s, "verify_pct_of_load": 100 * verify_s / load_s,
            "size_check_pct_of_load": 100 * size_s / load_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint bytes of this rank, in GB")
    parser.add_argument("--files", type=int, default=8, help="shard files of this rank")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    speeds = hash_speeds(256 << 20)
    print("checksum speed over a 256 MiB buffer, one core:")
    for name, gbs in sorted(speeds.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<18} {gbs:6.2f} GB/s")
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-verify-", dir=args.dir) as tmp:
        c = checkpoint_costs(Path(tmp) / "iter_0000001", args.gb, args.files)
    print(f"one rank's checkpoint: {c['bytes'] / 1e9:.2f} GB in {c['files']} files")
    print(f"  save (torch.save + fsync)        {c['save_s']:7.2f} s")
    print(f"  + record sizes and checksums     {c['record_s']:7.2f} s  = {c['record_pct_of_save']:5.1f}% of the save")
    print(f"  load (torch.load)                {c['load_s']:7.2f} s")
    print(f"  + verify sizes and checksums     {c['verify_checksum_s']:7.2f} s  = {c['verify_pct_of_load']:5.1f}% "
          f"of the load ({c['checksum_gb_per_s_per_rank']:.2f} GB/s per rank)")
    print(f"  + verify sizes only              {c['verify_size_s']:7.4f} s  = {c['size_check_pct_of_load']:5.2f}% "
          "of the load")
    if args.json:
        Path(args.json).write_text(json.dumps({"hash_gb_per_s": speeds, **c}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
