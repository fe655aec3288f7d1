"""Engine parity (a benchmark, not a test): the evidence that a refactor of the engine moves nothing.

A. Round-by-round reproduction of two cached runs by today's code, through the benchmarks' own
   functions (imported, not copied, in a child process whose project is the tree's), written into a
   temporary directory instead of the cache:
   - field: `make field-settings`' default row (`dynsam+sgd`) on the headline setting (MNIST-5k,
     Dirichlet 0.1, 20 clients), seed 1, at the pinned host speed (`bench.algorithms.run_job` of
     `bench.field_settings.job`; cached in bench/results/algorithms_runs/pinned_speed/);
   - attacks: `make attacks`' default fold (`attacks_report.DEFAULT_FOLD`) against `sign_flip@0.2`,
     seed 1 (`bench.attacks._job`; cached in bench/results/attacks_runs/).
   Every round's accuracy (and served accuracy where the cache has it) is compared with the cached
   file: rounds compared, rounds identical (exact float equality), the largest absolute difference
   and the first differing round; other recorded counters (loss, clipped, rejected, ...) are
   compared beside (`also`). The same runs are made with the old code too (unless --skip-old-runs),
   and the new runs compared with them (`new_vs_old`): a cached file made by a commit older than
   --old-ref may not reproduce at --old-ref either, and then only that comparison says whether the
   refactor moved anything (a run's last bits also follow the host's torch kernels: on an AVX-512
   Intel host v0.1.0 reproduced neither cached file, made on another host, and forcing AVX2 kernels
   moved the numbers without matching them). The exit status is 1 when a new run differs from the
   old code's (from the cache with --skip-old-runs).
B. Coordinator throughput beside the old code: `bench/runtime.py --only scale` (updates/s and the
   coordinator's peak RSS at 100, 300 and 1,000 swarm devices a round) for the old code (a
   `git worktree` of --old-ref, v0.1.0 by default, put first on PYTHONPATH; the modules imported are
   checked to come from it) and for this working tree, interleaved (old, new, new, old, ...) in one
   invocation, each into a temporary --out that starts from the tree's own committed runtime.json (so
   runtime.py keeps its overhead part instead of rerunning it, and the committed results stay as they
   are), with RUNTIME_SHIM for a bug of v0.1.0's runtime.py (below). The summary is the median over
   repeats per size, with new/old updates/s and the RSS change; updates/s moves by a third between
   invocations on 2 shared cores, so a ratio within that is noise.

    nice -n 10 .venv/bin/python -m bench.engine_parity                # `make engine-parity`; A and B
    .venv/bin/python -m bench.engine_parity --only field               # A's field run only (or attacks)
    .venv/bin/python -m bench.engine_parity --only runtime --runtime-repeats 3

Writes bench/results/engine_parity.json and engine_parity.md (--out PATH: PATH.json and PATH.md); with
--only, the other parts are kept from the previous file. Each finished run is cached in --work
(default: the system's temporary directory) under a key of the code it ran (HEAD, the diff and the
untracked files, outside bench/results and documentation), so a stopped run resumes and an edited tree
runs again; --fresh ignores the cache. A worktree this creates is removed at the end (--keep-worktree).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from . import provenance

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PARTS = ("field", "attacks", "runtime")
FIELD_ROW, FIELD_SEED = "dynsam+sgd", 1  # the default row of v0.1.0's field-settings, its first seed
ATTACK_RUN, ATTACK_SEED = "sign_flip@0.2", 1
SERIES = ("accuracy", "served_accuracy")  # compared round by round where the cached run has them
ALSO = {"field": ("loss", "ema_accuracy", "records", "device_classes", "host_samples_per_s"),
        "attacks": ("attackers", "attacker_updates_sent", "attacker_updates_folded", "honest_updates",
                    "honest_left_out", "clipped", "rejected")}
# what does not decide the engine's numbers: left out of a tree's code key
NOT_CODE = (":!bench/results", ":!*.md", ":!docs", ":!Makefile", ":!bench/engine_parity.py",
            ":!tests/test_engine_parity.py")
# bench/runtime.py's scale part as runtime.py runs it, but for one bug of the harness (not the engine) that v0.1.0
# has: its swarm_update passes RoundSettings().codec ("auto") to codec.encode, which refuses it. "auto" is resolved
# by the model's size as the coordinator resolves it (codec.resolve), so the swarm sends what the coordinator
# expects; the same for the old and the new code, and nothing where runtime.py names a codec itself
RUNTIME_SHIM = """
import runpy, sys
from edgefl_protocol import codec
_encode = codec.encode
def encode(tensors, *args, **kwargs):
    name = args[0] if args else kwargs.get("codec", "float32")
    if name == codec.AUTO:
        name = codec.resolve(name, sum(int(a.size) for a in tensors.values()))
        print("engine_parity shim: codec auto resolved to " + name, file=sys.stderr, flush=True)
        args, kwargs = (name, *args[1:]) if args else (), {**kwargs, **({} if args else {"codec": name})}
    return _encode(tensors, *args, **kwargs)
codec.encode = encode
runpy.run_module("bench.runtime", run_name="__main__", alter_sys=True)
"""
IMPORT_CHECK = ("import json, broker_coordinator, edge_agent, edgefl_protocol, models, bench.runtime; "
                "print(json.dumps({m.__name__: m.__file__ for m in "
                "(broker_coordinator, edge_agent, edgefl_protocol, models, bench.runtime)}))")


# --- comparison (pure) --------------------------------------------------------------------------

def same_value(a: float, b: float) -> bool:
    """Exact equality, NaN equal to NaN (a round with no loss)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def compare_series(cached: list[float], fresh: list[float]) -> dict[str, Any]:
    """Round by round (1-based rounds): how many are compared and identical, the largest absolute
    difference, and the first round that differs (a round only one side has counts as differing)."""
    n = min(len(cached), len(fresh))
    differs = [i + 1 for i in range(n) if not same_value(cached[i], fresh[i])]
    gaps = [abs(cached[i] - fresh[i]) for i in range(n) if not same_value(cached[i], fresh[i])]
    first = differs[0] if differs else (n + 1 if len(cached) != len(fresh) else None)
    return {"rounds_cached": len(cached), "rounds_fresh": len(fresh), "rounds_compared": n,
            "rounds_identical": n - len(differs), "max_abs_diff": max(gaps, default=0.0),
            "first_differing_round": first}


def compare_runs(cached: dict, fresh: dict, also: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every series of SERIES the cached run holds, and whether each key of `also` it holds is equal."""
    series = {k: compare_series(cached[k], fresh.get(k, [])) for k in SERIES if k in cached}
    equal = {k: json.dumps(cached[k], sort_keys=True) == json.dumps(fresh.get(k), sort_keys=True)
             for k in also if k in cached}
    identical = all(s["rounds_identical"] == s["rounds_cached"] == s["rounds_fresh"] for s in series.values())
    return {"series": series, "also": equal, "identical": bool(series) and identical}


def interleaved(repeats: int) -> list[tuple[str, int]]:
    """The runtime invocations in order: old, new, then new, old, ... (each pair reversed from the last),
    so that a load that drifts during the run weighs on both sides alike."""
    order = []
    for i in range(repeats):
        order += [("old", i), ("new", i)] if i % 2 == 0 else [("new", i), ("old", i)]
    return order


def throughput_summary(runs: list[dict]) -> list[dict[str, Any]]:
    """Per size: the median over repeats of each side's updates/s and peak RSS, new/old and the change."""
    by: dict[int, dict[str, list[dict]]] = {}
    for run in runs:
        for row in run["scale"]:
            by.setdefault(row["size"], {"old": [], "new": []})[run["label"]].append(row)
    out = []
    for size in sorted(by):
        old, new = by[size]["old"], by[size]["new"]
        if not (old and new):
            continue
        med = {side: {k: statistics.median(r[k] for r in rows) for k in ("updates_per_s", "peak_rss_mb")}
               for side, rows in (("old", old), ("new", new))}
        out.append({"size": size, "repeats": [len(old), len(new)],
                    "old_updates_per_s": med["old"]["updates_per_s"], "new_updates_per_s": med["new"]["updates_per_s"],
                    "updates_per_s_ratio": med["new"]["updates_per_s"] / med["old"]["updates_per_s"],
                    "old_peak_rss_mb": med["old"]["peak_rss_mb"], "new_peak_rss_mb": med["new"]["peak_rss_mb"],
                    "peak_rss_change_mb": med["new"]["peak_rss_mb"] - med["old"]["peak_rss_mb"],
                    "peak_rss_change_pct": 100 * (med["new"]["peak_rss_mb"] / med["old"]["peak_rss_mb"] - 1)})
    return out


# --- code, trees and cache ----------------------------------------------------------------------

def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True).stdout


def code_key(tree: Path) -> str:
    """A short hash of the code a tree runs: HEAD, its diff and its untracked files (outside NOT_CODE)."""
    h = hashlib.sha256(git(tree, "rev-parse", "HEAD").encode())
    h.update(git(tree, "diff", "HEAD", "--binary", "--", ".", *NOT_CODE).encode())
    for name in sorted(git(tree, "ls-files", "--others", "--exclude-standard", "--", ".", *NOT_CODE).split("\n")):
        if name and (tree / name).is_file():
            h.update(name.encode() + b"\0" + (tree / name).read_bytes())
    return h.hexdigest()[:12]


def tree_state(tree: Path) -> dict[str, Any]:
    changed = [line for line in git(tree, "status", "--porcelain", "--", ".", ":!bench/results").splitlines() if line]
    return {"head": git(tree, "rev-parse", "--short", "HEAD").strip(), "code_key": code_key(tree), "changed": changed}


@contextmanager
def worktree(ref: str, path: Path, keep: bool) -> Iterator[Path]:
    """The old code checked out at `path` (added if missing, removed afterwards unless kept or found)."""
    want = git(ROOT, "rev-parse", f"{ref}^{{commit}}").strip()
    made = not path.exists()
    if made:
        git(ROOT, "worktree", "add", "--detach", str(path), ref)
    have = git(path, "rev-parse", "HEAD").strip()
    if have != want:
        raise SystemExit(f"{path} is at {have[:7]}, not {ref} ({want[:7]}): remove it or pass --old-tree")
    try:
        yield path
    finally:
        if made and not keep:
            git(ROOT, "worktree", "remove", "--force", str(path))


def cached_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def save_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


@contextmanager
def redirected(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


# --- A: reproduction ----------------------------------------------------------------------------

def run_field(dest: Path) -> tuple[Path, Path]:
    """The field-settings run, by `bench.algorithms.run_job`, with its results root moved to `dest`:
    (the cached file, the fresh one)."""
    from . import algorithm_jobs, field_settings
    from .algorithms import run_job
    from .settings import HEADLINE

    job = field_settings.job(HEADLINE, FIELD_ROW, FIELD_SEED)
    cached = job.path
    with redirected(algorithm_jobs, "RESULTS", dest):
        fresh = job.path
        assert RESULTS not in fresh.parents, fresh
        run_job(job)
    return cached, fresh


def run_attack(dest: Path) -> tuple[Path, Path]:
    """The attack run, by `bench.attacks._job`, with its runs directory moved to `dest`."""
    from . import attacks
    from .attacks_report import DEFAULT_FOLD, HEADLINE, run_key

    args = (HEADLINE, ATTACK_RUN, DEFAULT_FOLD, ATTACK_SEED, attacks.ROUNDS)
    cached = attacks.RUNS / f"{run_key(*args)}.json"
    with redirected(attacks, "RUNS", dest):
        print(attacks._job(args), flush=True)
    return cached, dest / cached.name


def run_one(part: str, dest: str) -> None:
    """In a child process started in a tree: one run into `dest`; prints where the cached and the fresh
    file are and where the project was imported from, as the last line (JSON)."""
    import broker_coordinator
    cached, fresh = (run_field if part == "field" else run_attack)(Path(dest))
    print(json.dumps({"cached": str(cached), "fresh": str(fresh), "imports": broker_coordinator.__file__}), flush=True)


def reproduce_in(tree: Path, part: str, dest: Path) -> dict[str, Any]:
    """`run_one` in a child process whose project is `tree`'s (first on PYTHONPATH; this module is loaded
    from this file as a module of `tree`'s bench package, so the old code needs no copy of it)."""
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('bench.engine_parity', {str(Path(__file__).resolve())!r}); "
            "m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; spec.loader.exec_module(m); "
            f"m.run_one({part!r}, {str(dest)!r})")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tree, env=tree_env(tree), capture_output=True, text=True,
                          timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(f"the {part} run in {tree} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if not Path(out["imports"]).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the {part} run in {tree} imported broker_coordinator from {out['imports']}")
    return out


def reproduce(part: str, label: str, tree: Path, work: Path, fresh_cache: bool) -> tuple[dict[str, Any], dict]:
    """Part A for one run with `tree`'s code (label "new": this working tree; "old": --old-ref), compared
    with the cached file of this checkout: (the comparison, the fresh run)."""
    key = code_key(tree)
    keep = work / "reproduce" / f"{part}-{label}-{key}.json"
    record = None if fresh_cache else cached_json(keep)
    if record is None:
        print(f"{part} ({label}, code {key}): running", flush=True)
        started = time.time()
        with tempfile.TemporaryDirectory(prefix="edgefl-parity-", dir=work) as tmp:
            out = reproduce_in(tree, part, Path(tmp))
            run = json.loads(Path(out["fresh"]).read_text())
            tree_cached = Path(out["cached"]).read_bytes()
        cached_file = Path(out["cached"]).resolve().relative_to(tree.resolve())
        record = {"cached_file": str(cached_file), "run": run, "ran_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "seconds": round(time.time() - started, 1), "code_key_after": code_key(tree),
                  "tree_cache_is_this_checkouts": tree_cached == (ROOT / cached_file).read_bytes()}
        save_json(keep, record)
    else:
        print(f"{part} ({label}, code {key}): cached in {keep}", flush=True)
    cached = json.loads((ROOT / record["cached_file"]).read_text())
    run = record["run"]
    return {"code": label, "cached_file": record["cached_file"], "cached_commit": cached.get("commit"),
            "cached_command": cached.get("command"), "code_key": key, "code_changed_during_run": key != record[
                "code_key_after"], "run_commit": run.get("commit"), "ran_at": record["ran_at"],
            "run_seconds": record["seconds"], "final_accuracy": {"cached": cached["accuracy"][-1],
                                                                 "fresh": run["accuracy"][-1]},
            **compare_runs(cached, run, ALSO[part])}, run


# --- B: runtime beside the old code -------------------------------------------------------------

def tree_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def imports_of(tree: Path) -> dict[str, str]:
    """Where a process started as the runtime runs is started imports the project from: every module
    must come from `tree` (the venv holds the checkout in editable mode)."""
    out = subprocess.run([sys.executable, "-c", IMPORT_CHECK], cwd=tree, env=tree_env(tree), capture_output=True,
                         text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"importing the project from {tree} failed:\n{out.stderr[-3000:]}")
    files = json.loads(out.stdout.strip().splitlines()[-1])
    wrong = {m: f for m, f in files.items() if not Path(f).resolve().is_relative_to(tree.resolve())}
    if wrong:
        raise RuntimeError(f"modules not imported from {tree}: {wrong}")
    return {m: str(Path(f).resolve().relative_to(tree.resolve())) for m, f in files.items()}


def runtime_once(label: str, tree: Path, work: Path) -> dict[str, Any]:
    """One `bench.runtime --only scale` of `tree`'s code, into a temporary --out."""
    key = code_key(tree)
    imports = imports_of(tree)
    print(f"runtime ({label}, {tree}): {imports['broker_coordinator']} imported from it", flush=True)
    with tempfile.TemporaryDirectory(prefix="edgefl-parity-runtime-", dir=work) as tmp:
        committed = tree / "bench" / "results" / "runtime.json"
        if committed.exists():  # runtime.py keeps the overhead part from it instead of rerunning it
            shutil.copy(committed, Path(tmp) / "runtime.json")
        command = [sys.executable, "-c", RUNTIME_SHIM, "--only", "scale", "--out", tmp]
        load, started = os.getloadavg(), time.time()
        proc = subprocess.run(command, cwd=tree, env=tree_env(tree), capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"bench.runtime ({label}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        result = json.loads((Path(tmp) / "runtime.json").read_text())
        shim = sorted({line for line in proc.stderr.splitlines() if line.startswith("engine_parity shim:")})
    scale = [{"size": r["size"], "updates_per_s": r["updates_per_s_median"], "peak_rss_mb": r["coordinator_peak_rss_mb"],
              "round_s": r["round_s_median"], "updates_per_cpu_s": r["updates_per_coordinator_cpu_s_median"],
              "rejected": sum(sum(x.get("rejected", {}).values()) for x in r["rounds"])} for r in result["scale"]]
    return {"label": label, "commit": git(tree, "rev-parse", "--short", "HEAD").strip(), "code_key": key,
            "code_changed_during_run": code_key(tree) != key,
            "imports": imports, "shim": shim,
            "command": "cd TREE && PYTHONPATH=TREE python -m bench.runtime --only scale --out TMP (RUNTIME_SHIM)",
            "reference_decode_ms": result["machine"].get("reference_decode_ms"), "load_start": list(load),
            "load_end": list(os.getloadavg()), "seconds": round(time.time() - started, 1), "scale": scale}


def runtime_part(old: Path, repeats: int, work: Path, fresh_cache: bool) -> dict[str, Any]:
    trees = {"old": old, "new": ROOT}
    # one session per pair of codes: a stopped run resumes its own session, never mixes in another's invocations
    session = work / "runtime" / f"{code_key(old)}-{code_key(ROOT)}"
    runs = []
    for label, i in interleaved(repeats):
        keep = session / f"{label}-{i}.json"
        run = None if fresh_cache else cached_json(keep)
        if run is None:
            run = {**runtime_once(label, trees[label], work), "repeat": i}
            save_json(keep, run)
        else:
            print(f"runtime ({label}, repeat {i}): cached in {keep}", flush=True)
        runs.append(run)
        print(f"runtime ({label}, repeat {i}): " + ", ".join(
            f"{r['size']}: {r['updates_per_s']:.0f} updates/s, {r['peak_rss_mb']:.0f} MB" for r in run["scale"]), flush=True)
    return {"runs": runs, "summary": throughput_summary(runs)}


# --- report -------------------------------------------------------------------------------------

def host() -> dict[str, Any]:
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch  # its kernels by instruction set decide the last bits of a run (cached runs came from other hosts)

    return {"name": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa_env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
                        if k in os.environ},
            "load_at_start": list(os.getloadavg())}


def shim_note(runs: list[dict]) -> str:
    fired = sorted({r["label"] for r in runs if r.get("shim")})
    if not fired:
        return "RUNTIME_SHIM never fired (runtime.py named a codec itself)."
    return (f"runtime.py's swarm_update passed codec \"auto\" to codec.encode, which refuses it, for the {' and '.join(fired)} "
            "code: RUNTIME_SHIM resolved it by the model's size as the coordinator does (" + "; ".join(
                sorted({line.split(': ', 1)[1] for r in runs for line in r.get("shim", [])})) + ").")


def markdown(result: dict) -> str:
    mw = result["measured_with"]
    lines = ["# Engine parity", "", f"Command: `{mw['command']}` at {mw['commit']} (working tree code key "
             f"{mw['working_tree']['code_key']}, {len(mw['working_tree']['changed'])} changed or untracked files) "
             f"on {mw['host']['name']} ({mw['host']['cpu']}, {mw['host']['cores']} cores, torch "
             f"{mw['host'].get('torch')} with {mw['host'].get('torch_cpu_capability')} kernels, load at start "
             f"{mw['host']['load_at_start'][0]:.2f}).", ""]
    rows = [(part, r) for key in ("reproduction", "reproduction_old") for part, r in result.get(key, {}).items()]
    if rows:
        lines += ["## A. Cached runs reproduced round by round", "",
                  "| run | code | cached file (its commit) | series | rounds compared | identical | max abs diff "
                  "| first differing round |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for part, r in rows:
            for name, s in r["series"].items():
                lines.append(f"| {part} | {r['code']} ({r['run_commit']}) | `{r['cached_file']}` ({r['cached_commit']}) "
                             f"| {name} | {s['rounds_compared']} | {s['rounds_identical']} / {s['rounds_cached']} "
                             f"| {s['max_abs_diff']:.4g} | {s['first_differing_round'] or '-'} |")
        lines.append("")
        for part, r in rows:
            differ = [k for k, v in r["also"].items() if not v]
            lines.append(f"- {part}, {r['code']} code: {'IDENTICAL' if r['identical'] else 'DIFFERS'} (code key "
                         f"{r['code_key']}{', which changed during the run' if r['code_changed_during_run'] else ''}; "
                         f"final {r['final_accuracy']['fresh']:.4f} against {r['final_accuracy']['cached']:.4f}; "
                         f"the run took {r['run_seconds']:.0f} s, finished {r['ran_at']}); also equal: "
                         f"{', '.join(k for k, v in r['also'].items() if v) or 'none'}"
                         + (f"; differ: {', '.join(differ)}" if differ else ""))
        lines.append("")
    if result.get("new_vs_old"):
        lines += ["The new code's runs against the old code's fresh runs, whatever the cache holds:", ""]
        for part, r in result["new_vs_old"].items():
            lines.append(f"- {part}: {'IDENTICAL' if r['identical'] else 'DIFFERS'}: " + "; ".join(
                f"{name} {s['rounds_identical']} / {s['rounds_compared']} rounds, max abs diff {s['max_abs_diff']:.4g}"
                for name, s in r["series"].items()) + "; also equal: "
                + (", ".join(k for k, v in r["also"].items() if v) or "none"))
        lines.append("")
    rt = result.get("runtime")
    if rt:
        lines += ["## B. Coordinator throughput, old code beside new (`bench.runtime --only scale`)", "",
                  f"Old: {rt['old_ref']} ({rt['old_commit']}) from a git worktree first on PYTHONPATH; new: this "
                  "working tree. Median over repeats, run interleaved. " + shim_note(rt["runs"]), "",
                  "| devices | old updates/s | new updates/s | new/old | old peak RSS MB | new peak RSS MB | RSS change |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for s in rt["summary"]:
            lines.append(f"| {s['size']} | {s['old_updates_per_s']:.0f} | {s['new_updates_per_s']:.0f} "
                         f"| {s['updates_per_s_ratio']:.3f} | {s['old_peak_rss_mb']:.0f} | {s['new_peak_rss_mb']:.0f} "
                         f"| {s['peak_rss_change_mb']:+.1f} MB ({s['peak_rss_change_pct']:+.1f}%) |")
        lines += ["", "Each invocation, in order:", "",
                  "| code (key) | repeat | updates/s (100 / 300 / 1,000) | peak RSS MB | decode ms | load start / end | s |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in rt["runs"]:
            lines.append(f"| {r['label']} {r['commit']} ({r['code_key']}{', changed during it' if r.get('code_changed_during_run') else ''}) | {r['repeat']} | "
                         + " / ".join(f"{x['updates_per_s']:.0f}" for x in r["scale"]) + " | "
                         + " / ".join(f"{x['peak_rss_mb']:.0f}" for x in r["scale"])
                         + f" | {r['reference_decode_ms']:.3f} | {r['load_start'][0]:.2f} / {r['load_end'][0]:.2f} "
                         f"| {r['seconds']:.0f} |")
        lines.append("")
    if result.get("seconds"):
        lines += ["Part runtimes (s): " + ", ".join(f"{k} {v:.0f}" for k, v in result["seconds"].items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=PARTS, help="one part: field or attacks (A), runtime (B)")
    p.add_argument("--out", type=Path, default=RESULTS / "engine_parity.json", help="PATH.json and PATH.md")
    p.add_argument("--old-ref", default="v0.1.0", help="the old code for B (default v0.1.0)")
    p.add_argument("--old-tree", type=Path, default=Path(tempfile.gettempdir()) / "edgefl-v0.1.0",
                   help="its git worktree (added if missing)")
    p.add_argument("--keep-worktree", action="store_true", help="keep a worktree this run added")
    p.add_argument("--runtime-repeats", type=int, default=4,
                   help="invocations per side in B (default 4; one is about 30 s on 2 cores)")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "edgefl-engine-parity",
                   help="the cache of finished runs (resumable)")
    p.add_argument("--fresh", action="store_true", help="rerun what the cache holds")
    p.add_argument("--skip-old-runs", action="store_true",
                   help="A without the old code's runs (they tell a moved engine from a cache this host does not reproduce)")
    args = p.parse_args(argv)
    parts = [args.only] if args.only else list(PARTS)
    out_json, out_md = args.out.with_suffix(".json"), args.out.with_suffix(".md")
    args.work.mkdir(parents=True, exist_ok=True)
    state = tree_state(ROOT)
    result = json.loads(out_json.read_text()) if args.only and out_json.exists() else {}
    result["measured_with"] = provenance.measured_with(
        provenance.invoked(), {}, host=host(), working_tree=state, old_ref=args.old_ref,
        note="A compares runs of this working tree's code with cached files made by older commits (cached_commit); "
             "B runs the old ref's and this tree's bench/runtime.py in one invocation")
    seconds = result.setdefault("seconds", {})
    needs_old = "runtime" in parts or not args.skip_old_runs
    with worktree(args.old_ref, args.old_tree, args.keep_worktree) if needs_old else nullcontext(None) as old:
        for part in ("field", "attacks"):
            if part in parts:
                started = time.time()
                result.setdefault("reproduction", {})[part], new_run = reproduce(part, "new", ROOT, args.work, args.fresh)
                if not args.skip_old_runs:  # and the new run against the old one, whatever the cache holds
                    result.setdefault("reproduction_old", {})[part], old_run = reproduce(
                        part, "old", old, args.work, args.fresh)
                    result.setdefault("new_vs_old", {})[part] = compare_runs(old_run, new_run, ALSO[part])
                seconds[part] = round(time.time() - started, 1)
        if "runtime" in parts:
            started = time.time()
            rt = runtime_part(old, args.runtime_repeats, args.work, args.fresh)
            rt.update(old_ref=args.old_ref, old_commit=git(old, "rev-parse", "--short", "HEAD").strip())
            result["runtime"] = rt
            seconds["runtime"] = round(time.time() - started, 1)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=1) + "\n")
    out_md.write_text(markdown(result))
    print(out_md.read_text())
    # the refactor moved something when a new run differs from the old code's (or, without it, from the cache)
    verdicts = [(result["new_vs_old"] if not args.skip_old_runs else result["reproduction"])[part]["identical"]
                for part in parts if part != "runtime"]
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
