"""Spool benchmark (issue 13): does a round's read stay flat as the spool's history grows?

    nice -n 10 .venv/bin/python -m bench.spool          # `make spool`; 3-6 minutes on 2 shared cores
    .venv/bin/python -m bench.spool --files 1000,10000  # a quick look

One spool directory per size (1,000 / 10,000 / 100,000 files), each with a
writer process and a reader process:
- the writer plays the device's application: small `.npz` batches (20 samples
  of a (3, 128) float32 sensor window and an int label) by atomic rename
  (`name.tmp`, then rename), and a half-written `.tmp` of its next batch left
  in the directory whenever the reader looks;
- the reader is the agent side: the real `open_source(...)` spool source with
  the default settings (consume = "move", window 5,000 samples, holdout 0.2,
  its state saved with fsync after every read), calling `read()` once per
  round and reporting the time of that call.
Writer and reader go in lockstep, so each round finds exactly the new files
the round was given. Growth: each spool fills to its size at 200 files a
round, every file read. Measurement: then `--rounds` rounds of `--per-round`
(50) new files each, taking the spools in turn, so the three sizes are timed
side by side under the same load from the machine's other jobs (the 2 cores
here are shared; timing the sizes one after another measured the load, not
the spool). `read_seconds` is the median `read()` wall time per size, with the
reader's CPU time beside it; `peak_rss_mb` is each reader process's peak RSS
(ru_maxrss) at the end. Writes bench/results/spool.json and spool.md. The
spools live in the system's temporary directory (about 3.5 GB in all) and are
removed afterwards (deleting 100,000 files takes a minute or two of it).
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
from bench import provenance

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SAMPLE_SHAPE = (3, 128)
GROW_PER_ROUND = 200  # x 20 samples stays under the window, so growth reads every file


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def writer(directory: str, rows: int, orders) -> None:  # noqa: ANN001 (a multiprocessing Connection)
    """Write `n` files per order by atomic rename, leave the next one half-written, answer the total.
    The batches cycle through 16 encoded ones: the reader's cost is the same, the writer's is less."""
    rng = np.random.default_rng(0)
    payloads = []
    for _ in range(16):
        buffer = io.BytesIO()
        np.savez(buffer, x=rng.standard_normal((rows, *SAMPLE_SHAPE), dtype=np.float32), y=rng.integers(0, 6, rows))
        payloads.append(buffer.getvalue())
    spool, written = Path(directory), 0
    while (n := orders.recv()) > 0:
        pending = spool / f"{written:08d}.npz.tmp"
        for _ in range(n):
            pending.write_bytes(payloads[written % len(payloads)])
            os.replace(pending, spool / f"{written:08d}.npz")
            written += 1
            pending = spool / f"{written:08d}.npz.tmp"
        pending.write_bytes(payloads[0][: len(payloads[0]) // 2])  # mid-write when the reader looks
        orders.send(written)


def reader(directory: str, state_dir: str, window: int, consume: str, orders) -> None:  # noqa: ANN001
    """The agent's side: one `read()` per order, answering its wall and CPU seconds."""
    from edge_agent.config import DataSettings
    from edge_agent.data_sources import open_source

    settings = DataSettings(source="spool", path=directory, window=window, consume=consume, state_dir=state_dir)
    settings.validate()
    source = open_source(settings, "classification")
    orders.send(rss_mb())
    while orders.recv() == "read":
        begin, begin_cpu = time.perf_counter(), time.process_time()
        source.read()
        orders.send((time.perf_counter() - begin, time.process_time() - begin_cpu))
    orders.send({"peak_rss_mb": round(rss_mb(), 1), "samples": source.samples, "files_read": source.files_read,
                 "not_read": source.not_read, "skipped": dict(source.skipped)})


class Spool:
    """One spool directory with its writer and reader processes."""

    def __init__(self, work: Path, size: int, rows: int, window: int, consume: str) -> None:
        self.size, self.written, self.dir = size, 0, work / f"spool-{size}"
        self.dir.mkdir(parents=True)
        context = multiprocessing.get_context("spawn")
        self.to_writer, theirs = context.Pipe()
        self.writer = context.Process(target=writer, args=(str(self.dir), rows, theirs), daemon=True)
        self.to_reader, theirs = context.Pipe()
        self.reader = context.Process(target=reader, args=(str(self.dir), str(work / f"state-{size}"), window, consume, theirs),
                                      daemon=True)
        self.writer.start()
        self.reader.start()
        self.rss_start = self.to_reader.recv()
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def round(self, files: int) -> tuple[float, float]:
        self.to_writer.send(files)
        self.written = self.to_writer.recv()
        self.to_reader.send("read")
        return self.to_reader.recv()

    def stop(self) -> dict:
        self.to_writer.send(0)
        self.to_reader.send("stop")
        summary = self.to_reader.recv()
        self.writer.join(30)
        self.reader.join(30)
        return summary


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


def run(sizes: list[int], per_round: int, rows: int, window: int, rounds: int, consume: str, work: Path) -> dict:
    started = time.perf_counter()
    spools = [Spool(work, size, rows, window, consume) for size in sizes]
    try:
        for spool in spools:
            while spool.written < spool.size:
                spool.round(min(GROW_PER_ROUND, spool.size - spool.written))
            print(f"{spool.size:>7,} files written and read ({time.perf_counter() - started:.0f} s)", flush=True)
        grown = time.perf_counter()
        loads = []
        for r in range(rounds):
            for spool in spools[r % len(spools):] + spools[:r % len(spools)]:
                wall, cpu = spool.round(per_round)
                spool.wall.append(wall)
                spool.cpu.append(cpu)
            loads.append(os.getloadavg()[0])
    finally:
        summaries = [spool.stop() for spool in spools]
    for spool, summary in zip(spools, summaries):
        if summary["samples"] != window or summary["skipped"] or summary["files_read"] != spool.written:
            raise SystemExit(f"spool {spool.size} misread: {summary}")
    return {
        "read_seconds": [statistics.median(s.wall) for s in spools],
        "read_seconds_p90": [sorted(s.wall)[int(0.9 * (len(s.wall) - 1))] for s in spools],
        "read_cpu_seconds": [statistics.median(s.cpu) for s in spools],
        "peak_rss_mb": [summary["peak_rss_mb"] for summary in summaries],
        "rss_before_first_read_mb": [round(s.rss_start, 1) for s in spools],
        "files_written": [s.written for s in spools],
        "load_average_while_timed": round(statistics.median(loads), 1),
        "growth_seconds": round(grown - started), "total_seconds": round(time.perf_counter() - started),
        "filesystem": filesystem(work)}


def write_table(path: Path, r: dict) -> None:
    lines = ["# Spool benchmark", "", f"Command: `{r['command']}`", "",
             f"Writer processes append {r['samples_per_file']}-sample `.npz` files ({r['sample_shape'][0]}x"
             f"{r['sample_shape'][1]} float32 + int label) by atomic rename; the agent's spool source "
             f"(consume = \"{r['consume']}\", window {r['window']:,} samples, one reader process per spool) "
             f"read every file as the spools grew, then was timed over {r['rounds']} rounds of "
             f"{r['files_per_round']} new files per spool, the three spools in turn "
             f"(machine load average {r['load_average_while_timed']} on {r['machine']['cores']} shared cores).", "",
             "| files in the spool's history | read() per round, median (ms) | p90 (ms) | reader CPU per read() (ms) "
             "| reader peak RSS (MB) | reader RSS before the first read (MB) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for i, files in enumerate(r["files"]):
        lines.append(f"| {files:,} | {1000 * r['read_seconds'][i]:.1f} | {1000 * r['read_seconds_p90'][i]:.1f} | "
                     f"{1000 * r['read_cpu_seconds'][i]:.1f} | {r['peak_rss_mb'][i]:.0f} | "
                     f"{r['rss_before_first_read_mb'][i]:.0f} |")
    lines += ["", f"read_seconds[{r['files'][-1]:,}] / read_seconds[{r['files'][0]:,}] = "
              f"**{r['ratio_last_to_first']:.2f}** (target: within 2x).", "",
              f"Machine: {r['machine']['cores']} cores shared with other jobs, Python {r['machine']['python']}, "
              f"spools on {r['filesystem']}; growth {r['growth_seconds']} s, {r['total_seconds']} s in all.", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", default="1000,10000,100000", help="spool sizes: files written in total")
    parser.add_argument("--per-round", type=int, default=50, help="new files each timed round finds")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per spool")
    parser.add_argument("--rows", type=int, default=20, help="samples per file")
    parser.add_argument("--window", type=int, default=5000)
    parser.add_argument("--consume", default="move", choices=["move", "delete", "keep"],
                        help="the spool's consume setting; not the default: writes spool_CONSUME.json/.md")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    sizes = [int(n) for n in args.files.split(",")]
    with tempfile.TemporaryDirectory(prefix="edgefl-spool-") as tmp:
        result = run(sizes, args.per_round, args.rows, args.window, args.rounds, args.consume, Path(tmp))
    record = {"files": sizes, "read_seconds": result.pop("read_seconds"), "peak_rss_mb": result.pop("peak_rss_mb"),
              "command": "python -m bench.spool" + ("" if args.files == "1000,10000,100000" else f" --files {args.files}")
                         + ("" if args.consume == "move" else f" --consume {args.consume}"),
              "window": args.window, "files_per_round": args.per_round, "rounds": args.rounds,
              "samples_per_file": args.rows, "sample_shape": list(SAMPLE_SHAPE), "consume": args.consume, "holdout": 0.2,
              **result, "machine": {"cores": os.cpu_count(), "python": platform.python_version()}}
    record["ratio_last_to_first"] = record["read_seconds"][-1] / record["read_seconds"][0]
    record["measured_with"] = provenance.measured_with(record["command"], {}, data="synthetic spool files",
                                                       note="a spool reader; no federation settings apply")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "spool" if args.consume == "move" else f"spool_{args.consume}"
    (args.out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    write_table(args.out / f"{name}.md", record)
    print(f"wrote {args.out / name}.json and .md; read ratio {record['ratio_last_to_first']:.2f}")


if __name__ == "__main__":
    main()
