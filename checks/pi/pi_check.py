"""`make pi-check`: the Raspberry Pi install of docs/OPERATOR.md, run under qemu-user aarch64 emulation on a
Pi 4, a Pi 5 and a Pi Zero 2 W CPU.

1. An arm64 Debian bookworm root (debootstrap, cached in /var/cache/edgefl-pi-root,
   PI_ROOT_CACHE to change) gets a fresh copy. The operator's side of docs/OPERATOR.md runs
   here as written (`make dist`, the edgefl:build block); the wheel is put where the guide's
   `scp` (edgefl:pi-copy) puts it, and the Pi's install block (edgefl:pi-install, or
   edgefl:pi-install-debian for --torch debian) runs in the root line by line, as written,
   `sudo` included (checks/pi/guide.py).
2. For each of pi4 (QEMU_CPU=cortex-a72), pi5 (cortex-a76) and zero2w (Pi Zero 2 W,
   cortex-a53, 4 cores, 512 MB), with the agent's default thread count for a 4-core
   Pi: imports; 20 training steps of every built-in model from the same weights and
   batches as on this x86 host, losses compared; `edge-agent status`; a 3-round
   `simulate` federation on the host's loopback broker in which one of three agents
   is the emulated aarch64 one.
3. For the Pis of --serve (pi4 and zero2w): the coordinator of that federation
   publishes serving releases (`[serving] publish = "served"`, as `run` does), the
   emulated agent fills its serving store (STATE_DIR/serving); then `edge-agent serve`
   runs in the root on that store and is asked over its Unix socket from the host
   (through ROOT/tmp) and from the guest's python: the store's current version, 200
   single-sample predictions (latency p50/p99, under emulation), the answers compared
   with the same version run on x86, the serve process's peak guest RSS
   (checks/pi/serve_probe.py). For the Zero 2 W, the agent's and the serve process's
   peak guest RSS against a 384 MB target (512 MB less what the OS keeps, as
   broker_coordinator/simulation/fleet.py limits a zero2w agent).
4. Writes bench/results/pi_check.json and pi_check.md.

Emulation is about 90x slower than a real Pi: it proves installs, numerics and
crashes, never speed. Logs go to CACHE/logs.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench import provenance

from . import guide
from . import root as pi_root
from . import serve_probe
from .guest_memory import METHOD_ADDED, GuestRss
from .memory import METHOD

PROJECT = Path(__file__).resolve().parents[2]
RESULTS = PROJECT / "bench" / "results"
PIS = {"pi4": "cortex-a72", "pi5": "cortex-a76", "zero2w": "cortex-a53"}
PI_NAMES = {"pi4": "Pi 4", "pi5": "Pi 5", "zero2w": "Pi Zero 2 W"}
PI_CORES = 4  # all three: the Zero 2 W's RP3A0 has 4 Cortex-A53 cores too
# the Zero 2 W's 512 MB less what Raspberry Pi OS Lite keeps (about 128 MB): fleet.py's zero2w memory limit
MEMORY_TARGETS_MB = {"zero2w": 384}
SERVE_REQUESTS = 200
MODELS = ["mnist_cnn", "mnist_mlp", "digits_mlp", "logreg60"]
GUEST_PROJECT = "/opt/edgefl"
GUEST_PYTHON = f"{GUEST_PROJECT}/.venv/bin/python"
SIZE_EXCLUDES = ["var/cache/apt", "var/lib/apt/lists", "var/log", "tmp", "root/.cache", ".edgefl-base-complete"]
# what to install: the guide's Pi block, or the other candidate measured beside it
CANDIDATES = {
    "pypi": {"build": "PyPI's aarch64 torch 2.9.1 wheel (CPU-only) in a plain venv", "block": "pi-install"},
    "debian": {"build": "Debian bookworm python3-torch (CPU-only), in a venv with --system-site-packages",
               "block": "pi-install-debian"},
}
README_CANDIDATE = "pypi"


def install_as_readme(root: Path, cpu: str, log: Path, echo, block: str) -> list[dict]:
    """The guide's operator side here (make dist, the wheel copied where its scp puts it), then its Pi block."""
    try:
        steps = guide.operator_side("build", root, skip_scp=True, echo=echo)  # its scp goes to the server
        steps += guide.operator_side("pi-copy", root, echo=echo)
        commands = guide.block(block)
    except guide.GuideError as exc:
        raise pi_root.SetupError(str(exc)) from None
    for command in commands:
        echo(f"  [{cpu}] {command}")
        started = time.monotonic()
        done = pi_root.run_guest(root, cpu, ["/bin/sh", "-c", command], timeout=3 * 3600)
        with open(log, "a") as handle:
            handle.write(f"$ {command}\n{done.stdout}\n")
        steps.append({"command": command, "ran": "in the root, as written", "exit": done.returncode,
                      "seconds": round(time.monotonic() - started)})
        if done.returncode != 0:
            raise pi_root.SetupError(f"the guide's Pi install (edgefl:{block}) failed at '{command}' (exit "
                                     f"{done.returncode}); see {log}:\n{done.stdout[-2000:]}")
    return steps


def _dist_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def extras_mb(site_packages: Path, project: str = "edgefl") -> tuple[float, list[str]]:
    """MB of the distributions in a venv that the project's runtime requirements (no extras) do not pull in.

    Sizes come from each distribution's RECORD; requirements from its METADATA (markers with `extra` skipped)."""
    dists: dict[str, tuple[Path, list[str]]] = {}
    for info in site_packages.glob("*.dist-info"):
        meta = (info / "METADATA").read_text(errors="replace") if (info / "METADATA").exists() else ""
        name = re.search(r"^Name: (.+)$", meta, re.M)
        requires = [r for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M) if "extra ==" not in r]
        if name:
            dists[_dist_name(name.group(1))] = (info, [_dist_name(re.split(r"[ ;<>=!~\[(]", r, 1)[0]) for r in requires])
    needed, todo = set(), [project]
    while todo:
        name = todo.pop()
        if name in needed or name not in dists:
            continue
        needed.add(name)
        todo += dists[name][1]
    extra_bytes, names = 0, []
    for name, (info, _) in dists.items():
        if name in needed or name in ("pip", "setuptools"):
            continue
        names.append(name)
        for line in (info / "RECORD").read_text().splitlines() if (info / "RECORD").exists() else []:
            parts = line.rsplit(",", 2)
            path = (info.parent / parts[0]).resolve()
            if path.is_file():
                extra_bytes += path.stat().st_size
    return round(extra_bytes / 2**20, 1), sorted(names)


INSTALLED_METHOD = ("du of the root after the install minus du of the debootstrap minbase root with python3 (both without "
                    f"{', '.join(SIZE_EXCLUDES)}): torch and all it needs, apt's packages, the venv, the project "
                    "checkout; minus what the dev extras added, where the install took them (dev_extras_mb)")


def without_dev_extras(root: Path, install: dict) -> None:
    """What `.[dev]` added, if the install took it, is not needed on a device: count it apart."""
    if "dev_extras_mb" in install:
        return
    venvs = list(root.glob("opt/edgefl/.venv/lib/python3*/site-packages"))
    extra, names = extras_mb(venvs[0]) if venvs else (0.0, [])
    install.update(dev_extras_mb=extra, dev_extras=names, installed_with_dev_extras_mb=install["installed_mb"],
                   installed_mb=round(install["installed_mb"] - extra, 1))
    parts = {"torch": "torch", "torch.libs": "torch.libs", "numpy": "numpy*", "sympy": "sympy", "networkx": "networkx"}
    install["breakdown_mb"] = {
        name: round(sum(pi_root.size_mb(p, []) for v in [*venvs, root / "usr/lib/python3/dist-packages"]
                        for p in v.glob(pattern)), 1)
        for name, pattern in parts.items()}
    checkout = pi_root.size_mb(root / GUEST_PROJECT.lstrip("/"), [".venv"])
    install["breakdown_mb"].update(project_checkout=checkout, venv_without_dev_extras=round(install["venv_mb"] - extra, 1),
                                   outside_the_venv=round(install["installed_with_dev_extras_mb"] - install["venv_mb"]
                                                          - checkout, 1))


def uncommitted_files() -> list[str]:
    """Files of this checkout that differ from HEAD (tracked, changed) or that HEAD lacks (untracked), outside
    bench/results: what a "+dirty" commit measured besides HEAD (`make dist` packs them). Reads git only
    (--no-optional-locks: the index is not refreshed)."""
    done = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=all", "--", ".",
                           ":!bench/results"], cwd=PROJECT, capture_output=True, text=True)
    return sorted(line[3:] for line in done.stdout.splitlines() if line.strip()) if done.returncode == 0 else ["unknown"]


def resize(args: argparse.Namespace, echo) -> int:
    path = RESULTS / f"pi_check_{args.torch}.json"
    report = json.loads(path.read_text())
    without_dev_extras(args.cache / f"pi-{args.torch}", report["install"])
    report["install"]["installed_method"] = INSTALLED_METHOD
    for pi in report["pis"].values():
        pi["installed_mb"] = report["install"]["installed_mb"]
    write_results(report)
    echo(f"{path.name}: installed {report['install']['installed_mb']} MB without the dev extras "
         f"({report['install']['dev_extras_mb']} MB: {', '.join(report['install']['dev_extras'])})")
    return 0


def measured(root: Path, cpu: str, argv: list[str], log: Path, timeout: float = 3600,
             extra_env: dict[str, str] | None = None) -> tuple[int, str, dict]:
    """Run argv in the root and sample its memory; (exit code, output, memory peaks)."""
    with open(log, "a") as handle:
        handle.write(f"$ QEMU_CPU={cpu} {' '.join(argv)}\n")
    process = pi_root.guest(root, cpu, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            extra_env=extra_env or {})
    sampler = GuestRss(process.pid, root)
    sampler.start()
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
        out += f"\n(killed after {timeout} s)"
    memory = sampler.stop()
    with open(log, "a") as handle:
        handle.write(f"{out}\n(exit {process.returncode}; memory {memory})\n")
    return process.returncode, out, memory


IMPORT_PROBE = """
import json, platform, sys, time
import numpy, torch
import edge_agent.agent, edge_agent.hardware as hw
from edgefl_models.architectures import build_model
print(json.dumps({"python": platform.python_version(), "machine": platform.machine(), "torch": torch.__version__,
                  "cuda": torch.version.cuda, "numpy": numpy.__version__, "lse_atomics": not hw._aarch64_without_atomics(),
                  "default_threads_4_cores": hw.default_threads(4), "probe": hw.probe()}))
time.sleep(1.0)
"""


def check_imports(root: Path, cpu: str, log: Path) -> dict:
    code, out, memory = measured(root, cpu, [GUEST_PYTHON, "-c", IMPORT_PROBE], log)
    info = json.loads(out.strip().splitlines()[-1]) if code == 0 else {}
    return {"ok": code == 0, "exit": code, "info": info, "memory": memory, "output": out[-500:] if code else ""}


def host_reference(inputs: dict[str, Path], threads: int, work: Path) -> dict[str, dict]:
    results = {}
    for model, path in inputs.items():
        out = work / f"{model}-x86.json"
        subprocess.run([sys.executable, str(PROJECT / "checks/pi/train_probe.py"), "train", str(path), str(out),
                        "--threads", str(threads)], check=True, cwd=PROJECT)
        results[model] = json.loads(out.read_text())
    return results


def check_training(root: Path, cpu: str, inputs: dict[str, Path], reference: dict[str, dict], threads: int,
                   log: Path) -> dict:
    runs = []
    plan = [(model, threads) for model in MODELS] + [("mnist_cnn", PI_CORES)]  # and all 4 cores once
    for model, n in plan:
        guest_out = f"/tmp/pi-check/{model}-{cpu}-{n}.json"
        code, out, memory = measured(root, cpu, [GUEST_PYTHON, "/tmp/pi-check/train_probe.py", "train",
                                                 f"/tmp/pi-check/{model}.npz", guest_out, "--threads", str(n)], log)
        run = {"model": model, "threads": n, "exit": code, "memory": memory}
        result_path = root / guest_out.lstrip("/")
        if code == 0 and result_path.exists():
            got = json.loads(result_path.read_text())
            want = reference[model]["final_loss"]
            run.update(final_loss=got["final_loss"], x86_final_loss=want, seconds=got["seconds"],
                       rel_diff=abs(got["final_loss"] - want) / abs(want), finite=all(map(math.isfinite, got["losses"])),
                       first_loss=got["losses"][0], x86_first_loss=reference[model]["losses"][0])
        else:
            run["output"] = out[-800:]
        runs.append(run)
    ok = all(r["exit"] == 0 and r.get("finite") for r in runs)
    cnn = [r for r in runs if r["model"] == "mnist_cnn" and r["threads"] == threads]
    return {"ok": ok, "runs": runs, "max_rel_diff": max((r.get("rel_diff", math.inf) for r in runs), default=math.inf),
            "train_rss_mb": cnn[0]["memory"]["guest_mb"] if cnn else None}


def federation(root: Path, cpu: str, threads: int, rounds: int, log_dir: Path, echo, serving: str = "off") -> dict:
    """A `simulate` federation, 3 agents, dev-000 being the emulated aarch64 agent run through chroot.
    `serving`: the coordinator's [serving] publish ("served" for the Pis whose serving store the check serves)."""
    from broker_coordinator.settings.round_settings import RoundSettings
    from broker_coordinator.simulation.simulate import SimulationSpec, simulate, spawn_agent

    out = root / "tmp" / f"pi-federation-{cpu}"
    shutil.rmtree(out, ignore_errors=True)
    spec = SimulationSpec(agents=3, rounds=rounds, dataset="digits", partition="iid", seed=0, out=out,
                          federation="pisim", agent_threads=1, startup_timeout=900, serving=serving)
    settings = RoundSettings(local_epochs=1, round_timeout=900, min_updates=3, codec="topk0.1+q4c64+zlib")
    emulated: dict = {}

    def spawn(config: Path, log_path: Path) -> subprocess.Popen:
        if config.parent.name != "dev-000":
            return spawn_agent(config, log_path)
        guest_config = "/" + str(config.relative_to(root))
        config.write_text(config.read_text().replace(str(root), ""))  # the same files, as the guest sees them
        handle = open(log_path, "wb")
        process = pi_root.guest(root, cpu, [f"{GUEST_PROJECT}/.venv/bin/edge-agent", "run", "--config", guest_config],
                                stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                extra_env={"EDGEFL_AGENT_DEVICE_THREADS": str(threads)})
        handle.close()
        emulated.update(config=guest_config, log=log_path, sampler=GuestRss(process.pid, root))
        emulated["sampler"].start()
        return process

    seen_rounds = []

    def echo_round(line: str) -> None:
        echo(f"    {line}")
        if line.startswith("round"):
            seen_rounds.append(line)
            if len(seen_rounds) == rounds and "config" in emulated:  # broker still up: the Pi's own status
                done = pi_root.run_guest(root, cpu, [f"{GUEST_PROJECT}/.venv/bin/edge-agent", "status", "--config",
                                                     emulated["config"]], timeout=600)
                emulated["status"] = {"exit": done.returncode, "output": done.stdout.strip().splitlines()}

    error = None
    try:
        history = simulate(spec, settings, echo=echo_round, spawn=spawn)
    except Exception as exc:  # a failed federation is a result, reported with its reason
        history, error = [], f"{type(exc).__name__}: {exc}"
    memory = emulated["sampler"].stop() if "sampler" in emulated else {}
    if "log" in emulated:
        shutil.copy(emulated["log"], log_dir / f"agent-{cpu}.log")
    store = None
    if "config" in emulated:  # the emulated agent's serving store ([serving] dir), as the host sees it
        from edge_agent.config import load_config
        try:
            guest_store = load_config(root / emulated["config"].lstrip("/")).serving.dir
            store = str(root / guest_store.lstrip("/")) if guest_store else None
        except Exception as exc:  # noqa: BLE001 - reported, the serve check then says why it has no store
            error = error or f"cannot read the emulated agent's config: {exc}"
    accepted = sum(1 for r in history if "dev-000" in r.get("devices", {}))
    rejected = sum(sum(r.get("rejected", {}).values()) for r in history)
    return {"rounds_completed": sum(1 for r in history if r["closed"] == "complete"), "rounds": rounds,
            "updates_accepted": accepted, "updates_rejected_all_devices": rejected,
            "accuracy": [r["accuracy"] for r in history], "agent_memory": memory,
            "status": emulated.get("status"), "error": error, "config": emulated.get("config"),
            "serving_store_host": store, "coordinator_serving": coordinator_serving(out),
            "settings": "3 agents (dev-000 emulated aarch64, 2 x86), digits_mlp on the digits dataset (iid), "
                        "1 local epoch, default codec, broker on 127.0.0.1"
                        + (f", coordinator [serving] publish = \"{serving}\"" if serving != "off" else "")}


def coordinator_serving(out: Path) -> dict | None:
    """What the federation's coordinator published for serving last (its serving.json), if it did."""
    from broker_coordinator.engine.serving import read_published
    published = read_published(out / "run" / "coordinator")
    return {k: published.get(k) for k in ("version", "round", "score", "metric", "weights")} if published else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("PI_ROOT_CACHE", "/var/cache/edgefl-pi-root")))
    parser.add_argument("--pis", default="pi4,pi5,zero2w", help=f"which of {', '.join(PIS)} (default: %(default)s)")
    parser.add_argument("--serve", default="pi4,zero2w",
                        help="the Pis whose federation publishes serving releases and whose serving store "
                             "`edge-agent serve` then serves (default: %(default)s; \"\" for none)")
    parser.add_argument("--serve-requests", type=int, default=SERVE_REQUESTS,
                        help="single-sample predictions timed per Pi (default: %(default)s)")
    parser.add_argument("--keep-other-pis", action="store_true",
                        help="keep the previous results of the Pis not in --pis (each keeps its own 'measured'), "
                             "e.g. to finish a run that stopped after some Pis")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--torch", choices=sorted(CANDIDATES), default=README_CANDIDATE,
                        help=f"which install to check ({README_CANDIDATE}: the README's)")
    parser.add_argument("--install-only", action="store_true",
                        help="install and measure the size, no Pi checks, no results written (for make pi-dp-sgd)")
    parser.add_argument("--sizes-only", action="store_true",
                        help="recompute the installed sizes of an existing run's root and results file, run nothing")
    parser.add_argument("--reuse-install", action="store_true",
                        help="skip the fresh copy and install when a previous run left an installed root")
    args = parser.parse_args()
    unknown = [p for p in [*args.pis.split(","), *filter(None, args.serve.split(","))] if p not in PIS]
    if unknown:
        parser.error(f"unknown Pi {', '.join(unknown)}: choose from {', '.join(PIS)}")
    echo = lambda line: print(line, flush=True)  # noqa: E731
    if args.sizes_only:
        return resize(args, echo)
    try:
        pi_root.preflight()
        report = run(args, echo)
    except pi_root.SetupError as exc:
        print(f"pi-check: {exc}", file=sys.stderr)
        return 2
    ok = all(p["train_ok"] and p["federation_rounds"] == args.rounds and p["updates_accepted"] == args.rounds
             and p.get("serve_ok", True) and p.get("within_384_mb", True) for p in report["pis"].values())
    return 0 if ok else 1


def run(args: argparse.Namespace, echo) -> dict:
    cache: Path = args.cache
    candidate = CANDIDATES[args.torch]
    base, root, logs = cache / "base", cache / f"pi-{args.torch}", cache / "logs" / args.torch
    logs.mkdir(parents=True, exist_ok=True)
    lock = open(cache / f".pi-{args.torch}.lock", "w")  # held until exit: one run per root
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise pi_root.SetupError(f"another pi-check is using {root}; wait for it to finish") from None
    pi_root.build_base(base, echo)
    install_log = logs / "install.log"
    first_cpu = PIS["pi4"] if "pi4" in args.pis.split(",") else PIS[args.pis.split(",")[0]]
    marker = root / ".edgefl-installed.json"
    if args.reuse_install and marker.exists():
        echo(f"reusing the installed root {root}")
        install = json.loads(marker.read_text())
    else:
        echo(f"fresh copy of the arm64 root in {root}; the guide's Pi install under QEMU_CPU={first_cpu}")
        pi_root.fresh_copy(base, root)
        install_log.write_text("")
        tree = uncommitted_files()  # what make dist packs besides HEAD
        with pi_root.mounted(root, cache / "apt-archives"):
            steps = install_as_readme(root, first_cpu, install_log, echo, candidate["block"])
        base_mb = pi_root.size_mb(base, SIZE_EXCLUDES)
        root_mb = pi_root.size_mb(root, SIZE_EXCLUDES)
        torch_dirs = [p for p in root.glob("usr/lib/python3/dist-packages/torch")] + \
            [p for p in root.glob("opt/edgefl/.venv/lib/python3*/site-packages/torch")]
        install = {"commands": steps, "from_guide_block": candidate["block"], "base_root_mb": base_mb, "root_mb": root_mb,
                   "installed_mb": round(root_mb - base_mb, 1),
                   "venv_mb": pi_root.size_mb(root / GUEST_PROJECT.lstrip("/") / ".venv", []),
                   "torch_package_mb": sum(pi_root.size_mb(p, []) for p in torch_dirs),
                   "installed_method": INSTALLED_METHOD, "uncommitted_at_make_dist": tree}
        marker.write_text(json.dumps(install))
    without_dev_extras(root, install)
    marker.write_text(json.dumps(install))
    echo(f"installed: {install['installed_mb']} MB (root {install['root_mb']} MB, minimal base "
         f"{install['base_root_mb']} MB)")

    work = root / "tmp" / "pi-check"
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy2(PROJECT / "checks/pi/train_probe.py", work / "train_probe.py")  # the check's probe, not the install
    inputs = {}
    for model in MODELS:
        inputs[model] = work / f"{model}.npz"
        subprocess.run([sys.executable, str(PROJECT / "checks/pi/train_probe.py"), "make-inputs", model,
                        str(inputs[model])], check=True, cwd=PROJECT)

    report: dict = {"torch": None, "candidate": args.torch, "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "command": "make pi-check",
                    "measured_with": {"commit": guide.commit(), "command": "make pi-check " + " ".join(sys.argv[1:]),
                                      "pis": args.pis, "serve": args.serve, "rounds": args.rounds, "torch": args.torch,
                                      "guide_blocks": ["build", "pi-copy", candidate["block"]],
                                      "uncommitted_at_start": uncommitted_files()},
                    "emulation": "qemu-user-static (Debian bookworm) via binfmt, chroot",
                    "cores_forced": PI_CORES, "memory_method": METHOD,
                    "memory_method_added": METHOD_ADDED, "install": install, "pis": {},
                    "serve_latency_note": serve_probe.LATENCY_NOTE,
                    "memory_targets_mb": {pi: {"limit_mb": mb, "why": "the board's 512 MB less about 128 MB that "
                                               "Raspberry Pi OS Lite keeps (an estimate; fleet.py's zero2w memory "
                                               "limit)", "applies_to": "the agent's peak guest RSS in the federation "
                                               "and the serve process's peak guest RSS, each"}
                                          for pi, mb in MEMORY_TARGETS_MB.items()}}
    previous = RESULTS / f"pi_check_{args.torch}.json"
    if args.keep_other_pis and previous.exists():
        old = json.loads(previous.read_text())
        for pi, result in old.get("pis", {}).items():
            if pi not in args.pis.split(","):
                result["kept_from_run"] = result.get("measured") or old.get("measured")
                report["pis"][pi] = result
        report["measured_with"]["kept_from_previous_run"] = sorted(report["pis"])
        echo(f"--keep-other-pis: kept {', '.join(sorted(report['pis'])) or 'nothing'} from {previous.name}")
    if args.install_only:  # the results files keep the last full check's report
        echo(f"--install-only: {root} is installed; bench/results/ left as it was (make pi-check writes it)")
        return report
    shutil.copy2(PROJECT / "checks/pi/serve_probe.py", work / "serve_probe.py")  # the guest's client probe
    with pi_root.mounted(root):
        for pi in args.pis.split(","):
            cpu = PIS[pi]
            log = logs / f"{pi}.log"
            log.write_text("")
            echo(f"{pi} (QEMU_CPU={cpu}): imports")
            imports = check_imports(root, cpu, log)
            if not imports["ok"]:
                raise pi_root.SetupError(f"import failed under {cpu}; see {log}:\n{imports['output']}")
            info = imports["info"]
            report["torch"] = f"{candidate['build']}: torch {info['torch']}, cuda {info['cuda']}, numpy {info['numpy']}"
            threads = info["default_threads_4_cores"]
            echo(f"{pi}: torch {info['torch']} on {info['machine']}, LSE atomics {info['lse_atomics']}, "
                 f"default threads for {PI_CORES} cores {threads}; 20 steps of {', '.join(MODELS)}")
            reference = host_reference(inputs, threads, work)
            training = check_training(root, cpu, inputs, reference, threads, log)
            for r in training["runs"]:
                echo(f"  {r['model']:<10} threads {r['threads']}  loss {r.get('final_loss', 'FAILED')}  "
                     f"x86 {r.get('x86_final_loss')}  rel diff {r.get('rel_diff')}  guest RSS {r['memory']['guest_mb']} MB")
            echo(f"{pi}: {args.rounds}-round federation with one emulated agent among x86 agents")
            serving = pi in args.serve.split(",")
            fed = federation(root, cpu, threads, args.rounds, logs, echo, serving="served" if serving else "off")
            report["pis"].pop(pi, None)
            report["pis"][pi] = {
                "name": PI_NAMES[pi], "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "qemu_cpu": cpu, "installed_mb": install["installed_mb"],
                "import_rss_mb": imports["memory"]["guest_mb"], "train_rss_mb": training["train_rss_mb"],
                "train_ok": training["ok"], "max_rel_diff_vs_x86": training["max_rel_diff"],
                "default_threads": threads, "federation_rounds": fed["rounds_completed"],
                "updates_accepted": fed["updates_accepted"],
                "edge_agent_status": fed["status"], "imports": {**info, "memory": imports["memory"]},
                "agent_rss_mb": fed["agent_memory"].get("guest_mb"),
                "agent_rss_incl_libs_mb": fed["agent_memory"].get("guest_incl_root_files_mb"),
                "training": training["runs"], "federation": fed}
            if serving:
                echo(f"{pi}: edge-agent serve on the serving store the emulated agent filled "
                     f"({fed['serving_store_host']})")
                serve = check_serve(root, cpu, fed, logs, work, args.serve_requests, echo)
                report["pis"][pi].update(serve_ok=serve["ok"], serve_version=serve.get("store_version"),
                                         serve_p50_ms=serve.get("latency", {}).get("p50_ms"),
                                         serve_p99_ms=serve.get("latency", {}).get("p99_ms"),
                                         serve_rss_mb=serve.get("memory", {}).get("guest_mb"),
                                         serve_rss_incl_libs_mb=serve.get("memory", {}).get("guest_incl_root_files_mb"),
                                         serve=serve)
                echo(f"{pi}: serve ok {serve['ok']}, version {serve.get('store_version')}, latency "
                     f"{serve.get('latency')}, peak guest RSS {serve.get('memory', {}).get('guest_mb')} MB"
                     + (f"; error {serve['error']}" if serve.get("error") else ""))
            if pi in MEMORY_TARGETS_MB:
                report["pis"][pi].update(memory_target(report["pis"][pi], MEMORY_TARGETS_MB[pi]))
                echo(f"{pi}: {report['pis'][pi]['memory_target']}")
            write_results(report)
    write_results(report)
    return report


def check_serve(root: Path, cpu: str, fed: dict, logs: Path, work: Path, requests: int, echo) -> dict:
    """`edge-agent serve` on the serving store the federation's emulated agent filled (serve_probe)."""
    if not fed.get("config") or not fed.get("serving_store_host"):
        return {"ok": False, "error": f"the federation left no emulated agent config or serving store "
                                      f"({fed.get('error')})"}
    return serve_probe.check_serve(root, cpu, [f"{GUEST_PROJECT}/.venv/bin/edge-agent"], fed["config"],
                                   Path(fed["serving_store_host"]), GUEST_PYTHON, work, logs / f"serve-{cpu}-check.log",
                                   echo, requests=requests)


def memory_target(pi: dict, limit_mb: float) -> dict:
    """The device class's memory target: the agent's and the serve process's peak guest RSS, each within it."""
    # judged on the fuller measure: memory.py's guest_mb misses the guest's libraries above 1 TiB (guest_memory.py)
    measured = {"agent_guest_incl_libs_mb": pi.get("agent_rss_incl_libs_mb"),
                "serve_guest_incl_libs_mb": pi.get("serve_rss_incl_libs_mb")}
    within = all(isinstance(v, (int, float)) and v > 0 and v <= limit_mb for v in measured.values())
    measured.update(agent_guest_mb=pi.get("agent_rss_mb"), serve_guest_mb=pi.get("serve_rss_mb"))
    return {"within_384_mb" if limit_mb == 384 else f"within_{limit_mb}_mb": within,
            "memory_target": {"limit_mb": limit_mb, **measured, "within": within,
                              "judged_on": "agent_guest_incl_libs_mb and serve_guest_incl_libs_mb",
                              "largest_training_probe_guest_incl_libs_mb": max(
                                  (r["memory"].get("guest_incl_root_files_mb", 0) for r in pi.get("training", [])),
                                  default=None),
                              "note": "peak guest RSS under qemu-user, the guest's libraries that qemu maps above 1 TiB "
                                      "included and qemu's own share left out (guest_memory.py); the emulator "
                                      "does not limit the guest to 512 MB, so this measures the need, it does not "
                                      "run the Pi out of memory; a missing measurement counts as not within"}}


def summary(report: dict) -> dict:
    keys = ["installed_mb", "import_rss_mb", "train_rss_mb", "train_ok", "max_rel_diff_vs_x86", "default_threads",
            "federation_rounds", "updates_accepted", "agent_rss_mb", "serve_ok", "serve_version", "serve_p50_ms",
            "serve_p99_ms", "serve_rss_mb", "agent_rss_incl_libs_mb", "serve_rss_incl_libs_mb", "within_384_mb"]
    return {"torch": report["torch"], "measured": report["measured"],
            "pis": {pi: {k: v.get(k) for k in keys} for pi, v in report["pis"].items()}}


def write_results(report: dict) -> None:
    """pi_check_<candidate>.json for each candidate; pi_check.json and .md for the README's, with the others beside."""
    ran = report.get("measured_with", {})
    report["measured_with"] = provenance.measured_with(
        report["command"], {},
        invoked=provenance.invoked(), pis=ran.get("pis"), serve=ran.get("serve"), rounds=ran.get("rounds"),
        torch=ran.get("torch"), guide_blocks=ran.get("guide_blocks"),
        **({"kept_from_previous_run": ran["kept_from_previous_run"]} if "kept_from_previous_run" in ran else {}),
        **({"uncommitted_at_start": ran["uncommitted_at_start"]} if "uncommitted_at_start" in ran else {}),
        note="install, training, a federation (one emulated agent among x86 ones on the host's loopback broker) and "
             "`edge-agent serve`, all under qemu-user emulation; commit: this checkout's HEAD, +dirty when tracked "
             "files other than bench/results differed from it; uncommitted_at_start (and install."
             "uncommitted_at_make_dist): the files that differed from HEAD or were not in it when the run started "
             "(and when make dist built the wheel the root installed)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"pi_check_{report['candidate']}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    main_path = RESULTS / f"pi_check_{README_CANDIDATE}.json"
    if not main_path.exists():
        return
    chosen = json.loads(main_path.read_text())
    chosen["candidates"] = {name: summary(json.loads((RESULTS / f"pi_check_{name}.json").read_text()))
                            for name in CANDIDATES if (RESULTS / f"pi_check_{name}.json").exists()}
    (RESULTS / "pi_check.json").write_text(json.dumps(chosen, indent=1, default=str) + "\n")
    (RESULTS / "pi_check.md").write_text(markdown(chosen))


def markdown(report: dict) -> str:
    install = report["install"]
    lines = ["# Pi check (`make pi-check`)", "",
             f"Measured {report['measured']} under qemu-user aarch64 emulation on the 2-core x86 machine; "
             f"torch: {report['torch']}.", "",
             f"Install (the guide's Pi block, as written, in a fresh Debian bookworm arm64 root): **{install['installed_mb']} MB** "
             f"added to a {install['base_root_mb']} MB minimal root (venv {install['venv_mb']} MB, torch package "
             f"{install['torch_package_mb']} MB). Method: {install['installed_method']}.", "",
             "| | " + " | ".join(f"{PI_NAMES[p]} ({PIS[p]})" for p in PIS) + " |", "|---|" + "---|" * len(PIS)]
    pis = [report["pis"].get(p, {}) for p in PIS]
    rows = [("default threads (4 cores)", "default_threads"), ("import RSS, MB (guest)", "import_rss_mb"),
            ("RSS training the MNIST CNN, MB (guest)", "train_rss_mb"), ("20 steps of every model ok", "train_ok"),
            ("max relative loss diff vs x86", "max_rel_diff_vs_x86"), ("federation rounds completed", "federation_rounds"),
            ("aarch64 agent's updates accepted", "updates_accepted"),
            ("agent's peak RSS in the federation, MB (guest)", "agent_rss_mb"),
            ("the same with the guest's libraries above 1 TiB, MB", "agent_rss_incl_libs_mb"),
            ("serve: answered as it should (`edge-agent serve`)", "serve_ok"),
            ("serve: serving store's current version", "serve_version"),
            ("serve: latency p50, ms (emulated, ~90x a Pi)", "serve_p50_ms"),
            ("serve: latency p99, ms (emulated, ~90x a Pi)", "serve_p99_ms"),
            ("serve: peak RSS, MB (guest)", "serve_rss_mb"),
            ("serve: the same with the guest's libraries above 1 TiB, MB", "serve_rss_incl_libs_mb"),
            ("agent and serve each within 384 MB (Zero 2 W target)", "within_384_mb")]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(_cell(p.get(key)) for p in pis) + " |")
    kept = {name: p["kept_from_run"] for name, p in report["pis"].items() if p.get("kept_from_run")}
    if kept:
        lines += ["", "Kept from an earlier run (`--keep-other-pis`): " + ", ".join(
            f"{PI_NAMES.get(n, n)} (measured {m})" for n, m in kept.items()) + "."]
    lines += ["", "`-`: not measured for that Pi (serve runs on the Pis of `--serve`, pi4 and zero2w by default; the "
              "384 MB target is the Zero 2 W's).", "",
              f"Memory: {report['memory_method']}." + (f" Added: {report['memory_method_added']}; the rows \"with "
              "the guest's libraries\" and the Zero 2 W's target use it." if report.get("memory_method_added") else ""),
              ""]
    lines += serve_markdown(report)
    lines += ["## Training runs (20 steps, same weights and batches)", "",
              "| Pi | model | threads | loss after 20 | x86 | relative diff | guest RSS MB | with the guest's libraries "
              "above 1 TiB, MB | qemu's own MB |", "|---|---|---|---|---|---|---|---|---|"]
    for name, p in report["pis"].items():
        for r in p.get("training", []):
            lines.append(f"| {name} | {r['model']} | {r['threads']} | {_cell(r.get('final_loss'))} | "
                         f"{_cell(r.get('x86_final_loss'))} | {_cell(r.get('rel_diff'))} | {r['memory']['guest_mb']} | "
                         f"{_cell(r['memory'].get('guest_incl_root_files_mb'))} | "
                         f"{r['memory']['qemu_mb_at_peak']} |")
    others = {k: v for k, v in report.get("candidates", {}).items() if k != report["candidate"]}
    for name, other in others.items():
        lines += ["", f"## Candidate not chosen: {name} ({other['torch']}, measured {other['measured']})", "",
                  "| | " + " | ".join(other["pis"]) + " |", "|---|" + "---|" * len(other["pis"])]
        for _label, key in [("", "installed_mb")] + rows:
            lines.append(f"| {key} | " + " | ".join(_cell(p.get(key)) for p in other["pis"].values()) + " |")
    lines += ["", "## `edge-agent status` on the emulated Pi (broker up, after the last round)", ""]
    for name, p in report["pis"].items():
        status = p.get("edge_agent_status") or {}
        lines += [f"{name} (exit {status.get('exit')}):", ""] + [f"    {s}" for s in status.get("output", [])] + [""]
    return "\n".join(lines) + "\n"


def serve_markdown(report: dict) -> list[str]:
    served = {name: p for name, p in report["pis"].items() if p.get("serve")}
    if not served and not any(name in report["pis"] for name in MEMORY_TARGETS_MB):
        return []
    lines = ["## `edge-agent serve` on the emulated Pi", "",
             "After the federation, whose coordinator published serving releases (`[serving] publish = \"served\"`), "
             "`edge-agent serve --config AGENT.toml --socket /tmp/pi-check/serve-CPU.sock` ran in the root on the "
             "serving store the emulated agent had filled ([serving] dir, by default STATE_DIR/serving). It was asked "
             "from the host through the root's /tmp with `edge_agent.serving.predict_over_socket`, one new "
             "connection per single-sample request (digits test samples), and from inside the root with the guest's "
             "python (client emulated too). **Latency: "
             f"{report.get('serve_latency_note', serve_probe.LATENCY_NOTE)}.**", "",
             "| Pi | store version (coordinator published) | sha256 ok | listening after, s | first request, ms | "
             "requests | p50 ms | p99 ms | max ms | agree with x86 | accuracy (digits test) | guest client (20) p50 ms | "
             "batch of 200, ms | peak RSS MB (guest) | with the guest's libraries above 1 TiB, MB | qemu's own MB | "
             "exit on SIGTERM | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in served.items():
        s = p["serve"]
        lat, mem, guest = s.get("latency", {}), s.get("memory", {}), s.get("guest_client", {})
        published = (p.get("federation", {}).get("coordinator_serving") or {}).get("version")
        lines.append(f"| {name} | {_cell(s.get('store_version'))} ({_cell(published)}) | "
                     f"{_cell(s.get('store', {}).get('sha256_ok'))} | {_cell(s.get('seconds_to_listen'))} | "
                     f"{_cell(s.get('first_request_ms'))} | {_cell(lat.get('n'))} | {_cell(lat.get('p50_ms'))} | "
                     f"{_cell(lat.get('p99_ms'))} | {_cell(lat.get('max_ms'))} | {_cell(s.get('agree_with_x86_single'))} | "
                     f"{_cell(s.get('accuracy_on_digits_test'))} | {_cell(guest.get('latency', {}).get('p50_ms'))} | "
                     f"{_cell(s.get('batch_request', {}).get('ms'))} | {_cell(mem.get('guest_mb'))} | "
                     f"{_cell(mem.get('guest_incl_root_files_mb'))} | "
                     f"{_cell(mem.get('qemu_mb_at_peak'))} | {_cell(s.get('exit_after_sigterm'))} | {_cell(s.get('ok'))} |")
    for name, p in served.items():
        if p["serve"].get("error"):
            lines.append(f"\n{name}: serve check error: {p['serve']['error']}")
    lines.append("")
    for name, limit in MEMORY_TARGETS_MB.items():
        p = report["pis"].get(name)
        if not p or "memory_target" not in p:
            continue
        t = p["memory_target"]
        lines += [f"### {PI_NAMES[name]}: memory target {limit} MB", "",
                  f"{PI_NAMES[name]} ({p['qemu_cpu']}, 4 cores, 512 MB): target {limit} MB for each process "
                  f"({report.get('memory_targets_mb', {}).get(name, {}).get('why', '')}). Agent's peak guest RSS in "
                  f"the federation with the guest's libraries above 1 TiB {_cell(t.get('agent_guest_incl_libs_mb'))} MB "
                  f"({_cell(t.get('agent_guest_mb'))} MB below 1 TiB, memory.py's guest_mb), serve's "
                  f"{_cell(t.get('serve_guest_incl_libs_mb'))} MB ({_cell(t.get('serve_guest_mb'))} MB); largest "
                  f"20-step training probe {_cell(t.get('largest_training_probe_guest_incl_libs_mb'))} MB: "
                  f"**within_384_mb: {str(p.get('within_384_mb')).lower()}**. {t.get('note', '')}.", "",
                  f"Threads: the agent's default for 4 cores ({_cell(p.get('default_threads'))}, cores minus one, "
                  "edge_agent/hardware.py default_threads), the same as on the Pi 4 and Pi 5: the agent picks threads "
                  "from the core count only, and a Cortex-A53 is ARMv8.0 like the Pi 4's A72, where the CPU-only "
                  "torch runs threaded (training runs below); the 4-thread MNIST CNN run shows what one more thread costs in "
                  "memory. Training set: the same models and batches as the other Pis, so the losses compare.", ""]
    return lines


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 0.01 else f"{value:.4f}".rstrip("0").rstrip(".")
    return "-" if value is None else str(value)


if __name__ == "__main__":
    sys.exit(main())
