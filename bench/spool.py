"""Spool benchmark (issue 13): does a round's read stay flat as the spool's history grows?

    nice -n 10 .venv/bin/python -m bench.spool          # `make spool`; about 3 minutes on 2 shared cores
    .venv/bin/python -m bench.spool --files 1000,10000  # a quick look

A writer process plays the device's application: it writes small `.npz`
batches (20 samples of a (3, 128) float32 sensor window and an int label) into
a spool directory by atomic rename (`name.tmp`, then rename), and leaves a
half-written `.tmp` of the next batch in the directory during every read. This
process is the agent side: the real `open_source(...)` spool source with the
default settings (consume = "move", window 5,000 samples, holdout 0.2, its
state saved with fsync after every read), calling `read()` once per round.
Writer and reader go in lockstep, so every round finds exactly
`--per-round` (50) new files whatever the load on the machine.

At 1,000 / 10,000 / 100,000 files written in total it records the median
`read()` time over the last rounds before that point (the window full in
all of them) and this process's peak RSS so far (ru_maxrss). Writes
bench/results/spool.json and spool.md (with the reader's CPU time per read,
which other jobs on the machine disturb less than wall time). The spool is made in the system's
temporary directory (about 3 GB at 100,000 files) and removed afterwards.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_agent.config import DataSettings  # noqa: E402
from edge_agent.data_sources import open_source  # noqa: E402

SAMPLE_SHAPE = (3, 128)


def writer(directory: str, rows: int, orders) -> None:  # noqa: ANN001 (a multiprocessing Connection)
    """Write `n` files per order, by atomic rename; then leave the next one half-written, and answer."""
    rng = np.random.default_rng(0)
    spool, written = Path(directory), 0
    while (n := orders.recv()) > 0:
        pending = spool / f"{written:08d}.npz.tmp"
        for _ in range(n):
            buffer = io.BytesIO()
            np.savez(buffer, x=rng.standard_normal((rows, *SAMPLE_SHAPE), dtype=np.float32),
                     y=rng.integers(0, 6, rows))
            pending.write_bytes(buffer.getvalue())
            os.replace(pending, spool / f"{written:08d}.npz")
            written += 1
            pending = spool / f"{written:08d}.npz.tmp"
        pending.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])  # mid-write when the reader looks
        orders.send(written)


def filesystem(path: Path) -> str:
    """The type of the filesystem holding `path` (longest mount point in /proc/mounts)."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            point, fstype = line.split()[1:3]
            if str(path).startswith(point) and len(point) > len(best):
                best, kind = point, fstype
    except OSError:
        pass
    return kind


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run(checkpoints: list[int], per_round: int, rows: int, window: int, median_rounds: int, work: Path) -> dict:
    spool = work / "spool"
    spool.mkdir(parents=True)
    settings = DataSettings(source="spool", path=str(spool), window=window, state_dir=str(work / "state"))
    settings.validate()
    source = open_source(settings, "classification")
    rss_start = rss_mb()
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=writer, args=(str(spool), rows, theirs), daemon=True)
    process.start()
    times: list[float] = []
    cpu: list[float] = []
    result = {"read_seconds": [], "read_seconds_p90": [], "read_cpu_seconds": [], "peak_rss_mb": [], "rounds": [],
              "load_average": []}
    started, written = time.perf_counter(), 0
    try:
        for checkpoint in checkpoints:
            while written < checkpoint:
                ours.send(min(per_round, checkpoint - written))
                written = ours.recv()
                begin, begin_cpu = time.perf_counter(), time.process_time()
                local = source.read()
                times.append(time.perf_counter() - begin)
                cpu.append(time.process_time() - begin_cpu)
            recent = sorted(times[-median_rounds:])
            result["read_seconds"].append(statistics.median(recent))
            result["read_seconds_p90"].append(recent[int(0.9 * (len(recent) - 1))])
            result["read_cpu_seconds"].append(statistics.median(cpu[-median_rounds:]))
            result["peak_rss_mb"].append(round(rss_mb(), 1))
            result["rounds"].append(len(times))
            result["load_average"].append(round(os.getloadavg()[0], 1))
            print(f"{written:>7,} files: read() median {1000 * result['read_seconds'][-1]:.1f} ms, peak RSS "
                  f"{result['peak_rss_mb'][-1]:.0f} MB, window {len(local.train) + len(local.held_out):,} samples "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        ours.send(0)
        process.join(30)
    if source.samples != window or sum(source.skipped.values()) or source.files_read != written:
        raise SystemExit(f"spool misread: {source.samples} samples in window, {source.files_read} of {written} files "
                         f"read, skipped {dict(source.skipped)}")
    result.update(rss_before_first_read_mb=round(rss_start, 1), total_seconds=round(time.perf_counter() - started),
                  filesystem=filesystem(work))
    return result


def write_table(path: Path, r: dict) -> None:
    lines = ["# Spool benchmark", "", f"Command: `{r['command']}`", "",
             f"A writer process appends {r['samples_per_file']}-sample `.npz` files ({r['sample_shape'][0]}x"
             f"{r['sample_shape'][1]} float32 + int label) by atomic rename; the agent's spool source "
             f"(consume = \"{r['consume']}\", window {r['window']:,} samples) reads {r['files_per_round']} new files "
             f"per round. read() is the median of the last {r['rounds_in_median']} rounds before each point; "
             f"RSS is the reader's peak so far.", "",
             "| files written | rounds | read() per round, median (ms) | p90 (ms) | CPU per read() (ms) | reader peak RSS (MB) "
             "| machine load average |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, files in enumerate(r["files"]):
        lines.append(f"| {files:,} | {r['rounds'][i]} | {1000 * r['read_seconds'][i]:.1f} | "
                     f"{1000 * r['read_seconds_p90'][i]:.1f} | {1000 * r['read_cpu_seconds'][i]:.1f} | "
                     f"{r['peak_rss_mb'][i]:.0f} | {r['load_average'][i]} |")
    lines += ["", f"read_seconds[{r['files'][-1]:,}] / read_seconds[{r['files'][0]:,}] = **{r['ratio_last_to_first']:.2f}**"
              f" (target: within 2x). RSS before the first read: {r['rss_before_first_read_mb']:.0f} MB.", "",
              f"Machine: {r['machine']['cores']} cores shared with other jobs, {r['machine']['python']}, spool on "
              f"{r['filesystem']}; {r['total_seconds']} s in all.", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", default="1000,10000,100000", help="checkpoints: files written in total")
    parser.add_argument("--per-round", type=int, default=50, help="new files the reader finds each round")
    parser.add_argument("--rows", type=int, default=20, help="samples per file")
    parser.add_argument("--window", type=int, default=5000)
    parser.add_argument("--median-rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    checkpoints = [int(n) for n in args.files.split(",")]
    with tempfile.TemporaryDirectory(prefix="edgefl-spool-") as tmp:
        result = run(checkpoints, args.per_round, args.rows, args.window, args.median_rounds, Path(tmp))
    record = {"files": checkpoints, "read_seconds": result.pop("read_seconds"),
              "peak_rss_mb": result.pop("peak_rss_mb"),
              "command": "python -m bench.spool" + ("" if args.files == "1000,10000,100000" else f" --files {args.files}"),
              "window": args.window, "files_per_round": args.per_round, "samples_per_file": args.rows,
              "sample_shape": list(SAMPLE_SHAPE), "consume": "move", "holdout": 0.2,
              "rounds_in_median": args.median_rounds, **result,
              "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                          "load_average_at_end": round(os.getloadavg()[0], 1)}}
    record["ratio_last_to_first"] = record["read_seconds"][-1] / record["read_seconds"][0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spool.json").write_text(json.dumps(record, indent=2) + "\n")
    write_table(args.out / "spool.md", record)
    print(f"wrote {args.out / 'spool.json'} and spool.md; read ratio {record['ratio_last_to_first']:.2f}")


if __name__ == "__main__":
    main()
