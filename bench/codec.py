"""Codec benchmark: bytes, speed and accuracy of every uplink codec.

    .venv/bin/python bench/codec.py                 # the full run (about 25 minutes on 2 cores)
    .venv/bin/python bench/codec.py --rounds 5 --seeds 1 --codecs float32,q8   # a quick look

Per codec, on the MNIST CNN (80,202 parameters) and on a 1,068,810-parameter
MLP (`mnist_mlp`):
- bytes per update: the whole signed update message as it goes on the wire
  (HMAC, header, metrics, tensor body), and bytes per parameter;
- encode and decode time: median of repeats on a real delta (one client's
  local training from the initial model);
- accuracy after a fixed number of rounds of the Dirichlet(0.1) MNIST-5k
  federation of bench/data/mnist5k_dir01_20clients.npz (20 clients, 10 drawn
  per round, FedAvg, the peer hyper-parameters of that file's README), with
  the device side keeping its error-feedback residual between rounds exactly
  as the agent does; the same cohorts and training seeds for every codec;
- decode-and-aggregate throughput on one core: signature check, header
  validation, codec decode and the fold into the streaming mean.

The federation runs in one process (the agent's training loop, the codec, the
coordinator's aggregation and server rule, no broker) so that the only
difference between rows is the codec. Writes bench/results/codec.json and
bench/results/codec.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from broker_coordinator.aggregation.streaming import StreamingMean  # noqa: E402
from broker_coordinator.reporting.evaluation import evaluate  # noqa: E402
from edge_agent.training import LocalSettings, train_locally  # noqa: E402
from edgefl_protocol import algorithms, codec, messages  # noqa: E402
from bench import provenance  # noqa: E402
from edgefl_models.architectures import build_model, get_weights, set_weights  # noqa: E402
from edgefl_models.datasets import Dataset, load_mnist5k, mnist_split_perm  # noqa: E402

PARTITION = ROOT / "bench" / "data" / "mnist5k_dir01_20clients.npz"
RESULTS = ROOT / "bench" / "results"
CODECS = [
    "float32", "float16", "q8", "q4c64+zlib",
    "topk0.1+q8+zlib", "topk0.1+q4c64+zlib", "topk0.05+q8+zlib", "topk0.05+q4c64+zlib", "topk0.02+q8+zlib",
]
ZSTD_PAIRS = ["q8c256", "topk0.1+q4c64", "topk0.05+q8", "topk0.1+q8"]  # bodies compressed both ways
FLOWER = {"bytes_per_param": 4.05, "bytes_per_client_round": 739_000,
          "note": "Flower 1.42 on the same 80,202-parameter CNN, measured side by side on loopback; "
                  "reported in issue 4, not measured here"}
KEY = b"bench-key-0123456789abcdef012345"
HP = dict(rounds=40, clients_per_round=10, epochs=2, batch_size=32, lr=0.05, lr_decay=0.998,
          weight_decay=1e-3, grad_clip=10.0)


def load_federation() -> tuple[list[Dataset], Dataset]:
    data = load_mnist5k()
    part = np.load(PARTITION, allow_pickle=False)
    if not np.array_equal(part["shuffle_perm"], mnist_split_perm()):
        raise SystemExit(f"{PARTITION} does not match the MNIST-5k split of edgefl_models.datasets")
    offsets, index = part["offsets"], part["train_idx"]
    clients = [data.train.subset(index[offsets[k]:offsets[k + 1]]) for k in range(len(offsets) - 1)]
    return clients, data.test


def signed_update(encoded: codec.Encoded, device: str, round_no: int, version: int, samples: int) -> bytes:
    update = messages.Update(device, round_no, version, samples, {"train_loss": 0.1, "train_seconds": 1.0},
                             encoded.body, encoded.codec, encoded.specs, "bench")
    return messages.encode_update(update, KEY)


def run_federation(codec_name: str, clients: list[Dataset], test: Dataset, rounds: int, seed: int) -> dict:
    """The Dirichlet(0.1) federation with FedAvg; the device side persists residuals like the agent."""
    torch.manual_seed(seed)
    model = build_model("mnist_cnn", seed)
    weights = get_weights(model)
    specs = codec.specs_of(weights)
    cap = sum(a.size for a in weights.values())
    algorithm = algorithms.get("fedavg")
    server = algorithm.server({})
    residuals: list[dict | None] = [None] * len(clients)
    cohort_rng = np.random.default_rng(seed)
    sizes, accuracy = [], []
    for round_no in range(1, rounds + 1):
        cohort = sorted(int(k) for k in cohort_rng.choice(len(clients), HP["clients_per_round"], replace=False))
        settings = LocalSettings(HP["epochs"], HP["batch_size"], HP["lr"] * HP["lr_decay"] ** (round_no - 1), 0.0,
                                 HP["weight_decay"], HP["grad_clip"])
        aggregate = StreamingMean(specs)
        for k in cohort:
            set_weights(model, weights)
            rule = algorithm.client({}, {}, {})
            result = train_locally(model, clients[k], rule, settings, seed * 1_000_003 + round_no * 1009 + k)
            rng = np.random.default_rng([seed, round_no, int(k)])
            encoded = codec.encode(result.delta, codec_name, residuals[k], rng)
            residuals[k] = encoded.residual
            wire = signed_update(encoded, f"dev-{k:03d}", round_no, round_no - 1, result.num_samples)
            sizes.append(len(wire))
            update = messages.decode_update(wire, 4 * cap + 65536, KEY)
            delta = codec.decode(update.codec, update.specs, update.body, specs, cap)
            aggregate.add(delta, server.weight(update.num_samples, update.metrics))
        weights = server.new_global(weights, aggregate.result())
        set_weights(model, weights)
        accuracy.append(evaluate(model, test)[0])
    return {"accuracy": accuracy[-1], "accuracy_curve": accuracy, "bytes_per_update": statistics.median(sizes)}


def sample_delta(arch: str, client: Dataset) -> dict[str, np.ndarray]:
    """A real delta: one client's local training (2 epochs) from the initial model."""
    model = build_model(arch, 0)
    rule = algorithms.get("fedavg").client({}, {}, {})
    return train_locally(model, client, rule, LocalSettings(epochs=2), seed=1).delta


def median_seconds(fn, repeats: int, clock=time.thread_time) -> float:
    """Median over repeats. The default clock is this thread's CPU time: the machine is shared, and CPU
    time is what one core spends, unaffected by waiting for a turn on it."""
    times = []
    for _ in range(repeats):
        started = clock()
        fn()
        times.append(clock() - started)
    return statistics.median(times)


def measure_sizes_and_speed(codec_name: str, delta: dict[str, np.ndarray], repeats: int) -> dict:
    specs = codec.specs_of(delta)
    cap = sum(a.size for a in delta.values())
    rng = np.random.default_rng(0)
    encoded = codec.encode(delta, codec_name, None, rng)
    wire = signed_update(encoded, "dev-000", 1, 0, 100)
    encode_s = median_seconds(lambda: codec.encode(delta, codec_name, None, rng), repeats)
    decode_s = median_seconds(lambda: codec.decode(encoded.codec, encoded.specs, encoded.body, specs, cap), repeats)
    return {"bytes_per_update": len(wire), "body_bytes": len(encoded.body), "bytes_per_param": len(wire) / cap,
            "encode_ms": 1000 * encode_s, "decode_ms": 1000 * decode_s}


def decode_aggregate_throughput(codec_name: str, delta: dict[str, np.ndarray], count: int, repeats: int,
                                clock=time.thread_time) -> float:
    """Updates per second through signature check, header checks, codec decode and the streaming fold."""
    specs = codec.specs_of(delta)
    cap = sum(a.size for a in delta.values())
    rng = np.random.default_rng(1)
    wires = []
    for i in range(count):
        noisy = {k: v + rng.normal(0, 1e-4, v.shape).astype(np.float32) for k, v in delta.items()}
        wires.append(signed_update(codec.encode(noisy, codec_name, None, rng), f"dev-{i:03d}", 1, 0, 100))

    def fold_all() -> None:
        aggregate = StreamingMean(specs)
        for wire in wires:
            update = messages.decode_update(wire, 4 * cap + 65536, KEY)
            aggregate.add(codec.decode(update.codec, update.specs, update.body, specs, cap), update.num_samples)
        aggregate.result()

    return count / median_seconds(fold_all, repeats, clock)


def compare_zstd(base: str, delta: dict[str, np.ndarray], repeats: int) -> dict:
    """zlib (what the codec uses) against zstandard on the identical uncompressed tensor body."""
    import zlib

    import zstandard

    body = codec.encode(delta, base, None, np.random.default_rng(0)).body
    zc, zd = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    out = {}
    for method, pack, unpack in (("zlib", lambda b: zlib.compress(b, 6), zlib.decompress),
                                 ("zstd", zc.compress, zd.decompress)):
        packed = pack(body)
        out[method] = {"body_bytes": len(packed), "encode_ms": 1000 * median_seconds(lambda: pack(body), repeats),
                       "decode_ms": 1000 * median_seconds(lambda: unpack(packed), repeats)}
    return out


def markdown(report: dict) -> str:
    fed = report["federation"]
    lines = [
        "# Uplink codec benchmark",
        "",
        f"Measured {report['measured_at']} on {report['machine']} (2 cores shared with other engineers' jobs; "
        f"encode/decode times and the throughput are medians of repeats in thread CPU time, i.e. one core's work; "
        f"the wall-clock throughput is in codec.json as `decode_updates_per_s_wall`). "
        f"Command: `{report['command']}`.",
        "",
        f"Accuracy: MNIST-5k, Dirichlet(0.1) over 20 clients (`bench/data/mnist5k_dir01_20clients.npz`), "
        f"{fed['clients_per_round']} clients per round, {fed['rounds']} rounds of **FedAvg** (the repository's "
        f"default algorithm), 2 local epochs, batch 32, lr 0.05 decaying 0.998 per round; mean over the seeds "
        f"shown (the same cohorts and training seeds for every codec); 'vs float32' compares with float32 on the "
        f"same seeds. Between seeds float32 alone moves by about a point, so differences of a few tenths are "
        f"within noise. Bytes are whole signed update messages (HMAC, header, metrics, body): for the CNN the "
        f"median over every update of the federation runs, for the 1M-parameter MLP (`mnist_mlp`) one update of "
        f"a real local-training delta.",
        "",
        "| codec | CNN bytes/update | CNN bytes/param | ratio vs float32 | encode ms | decode ms | "
        "accuracy (after rounds) | vs float32 (points) | decode+fold updates/s (1 core) | "
        "1M-MLP bytes/update | 1M-MLP bytes/param | 1M-MLP encode ms | 1M-MLP decode ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in report["codecs"].items():
        lines.append(
            f"| `{name}` | {r['federation_bytes_per_update']:,.0f} | {r['bytes_per_param']:.3f} | "
            f"{r['compression_ratio']:.1f}x | {r['cnn']['encode_ms']:.2f} | {r['cnn']['decode_ms']:.2f} | "
            + (f"{100 * r['accuracy']:.2f}% (seeds {','.join(map(str, r['seeds']))}) | "
               f"{100 * (r['accuracy'] - r['accuracy_float32']):+.2f} | " if r["accuracy"] is not None else
               "not run | - | ")
            + f"{r['decode_updates_per_s']:,.0f} | {r['mlp1m']['bytes_per_update']:,} | {r['mlp1m']['bytes_per_param']:.3f} | "
            f"{r['mlp1m']['encode_ms']:.1f} | {r['mlp1m']['decode_ms']:.1f} |")
    f = report["flower"]
    lines.append(f"| Flower 1.42 *(reported in issue 4, not measured here)* | ~{f['bytes_per_client_round']:,} per client "
                 f"per round on the wire | {f['bytes_per_param']:.2f} each way | - | - | - | - | - | - | - | - | - | - |")
    lines += ["", f"Default codec: **`{report['default']}`** ({report['default_reason']}).", ""]
    if report.get("zstd"):
        lines += ["## zlib against zstd (the same uncompressed body, CNN delta)", "",
                  "| body of | zlib bytes | zstd bytes | zlib compress+decompress ms | zstd compress+decompress ms |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for name, z in report["zstd"].items():
            lines.append(f"| `{name}` | {z['zlib']['body_bytes']:,} | {z['zstd']['body_bytes']:,} | "
                         f"{z['zlib']['encode_ms'] + z['zlib']['decode_ms']:.2f} | "
                         f"{z['zstd']['encode_ms'] + z['zstd']['decode_ms']:.2f} |")
        lines += ["", report["zstd_verdict"], ""]
    lines += ["Targets (issue 4): >= 16x fewer upload bytes than float32 with <= 0.5 points of accuracy lost; "
              ">= 500 updates/s decoded and folded for the MNIST CNN.", ""]
    return "\n".join(lines)


def choose_default(rows: dict) -> tuple[str, str]:
    """Smallest bytes among codecs within 0.5 points of float32 accuracy."""
    ok = {n: r for n, r in rows.items() if r["accuracy"] is not None and len(r["seeds"]) == max(
        len(x["seeds"]) for x in rows.values()) and r["accuracy"] >= r["accuracy_float32"] - 0.005}
    best = min(ok, key=lambda n: rows[n]["bytes_per_param"])
    r = rows[best]
    return best, (f"the fewest bytes among codecs within 0.5 points of float32: {r['compression_ratio']:.1f}x fewer "
                  f"bytes, {100 * (r['accuracy'] - r['accuracy_float32']):+.2f} points")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=HP["rounds"])
    parser.add_argument("--seeds", type=int, default=2, help="federation seeds per codec (accuracy is their mean)")
    parser.add_argument("--codecs", default=",".join(CODECS))
    parser.add_argument("--repeats", type=int, default=21, help="repeats for encode/decode medians")
    parser.add_argument("--throughput-updates", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--reuse", action="store_true",
                        help="reuse federation runs (same codec, seed, rounds) saved in OUT/codec_runs/; "
                             "only valid while the codec's output is unchanged")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--cached-only", action="store_true",
                        help="report only federation runs already saved in OUT/codec_runs/ (run none)")
    parser.add_argument("--federation-only", action="store_true",
                        help="only run (and save) the federations, e.g. one seed per process in parallel")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core: the throughput figure is per core, and training is deterministic
    codecs = [c for c in args.codecs.split(",") if c]
    clients, test = load_federation()
    deltas = {"cnn": sample_delta("mnist_cnn", clients[4]), "mlp1m": sample_delta("mnist_mlp", clients[4])}
    params = {k: sum(a.size for a in d.values()) for k, d in deltas.items()}

    cache = args.out / "codec_runs"
    cache.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[int, dict]] = {}  # codec -> seed -> federation run
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    for name in codecs if args.federation_only else dict.fromkeys(["float32", *codecs]):
        runs[name] = {}
        for seed in seeds:
            started = time.time()
            path = cache / f"{name}_seed{seed}_rounds{args.rounds}.json"
            if (args.reuse or args.cached_only) and path.exists():
                runs[name][seed] = json.loads(path.read_text())
            elif args.cached_only:
                print(f"{name:24s} seed {seed}: not run (--cached-only)", flush=True)
                continue
            else:
                runs[name][seed] = run_federation(name, clients, test, args.rounds, seed)
                path.write_text(json.dumps(runs[name][seed]))
            print(f"{name:24s} seed {seed}: accuracy {100 * runs[name][seed]['accuracy']:.2f}%  "
                  f"({time.time() - started:.0f} s)", flush=True)
    if args.federation_only:
        return
    rows = {}
    for name in dict.fromkeys(["float32", *codecs]):
        sizes = {k: measure_sizes_and_speed(name, d, args.repeats) for k, d in deltas.items()}
        done = sorted(set(runs[name]) & set(runs["float32"]))  # accuracy is compared on the same seeds
        if done:
            fed_bytes = statistics.median(runs[name][s]["bytes_per_update"] for s in done)
            fed_bytes32 = statistics.median(runs["float32"][s]["bytes_per_update"] for s in done)
        else:  # no federation run: bytes of the sample delta
            fed_bytes, fed_bytes32 = sizes["cnn"]["bytes_per_update"], measure_sizes_and_speed(
                "float32", deltas["cnn"], 1)["bytes_per_update"]
        rows[name] = {
            "bytes_per_param": fed_bytes / params["cnn"],
            "compression_ratio": fed_bytes32 / fed_bytes,
            "accuracy": statistics.mean(runs[name][s]["accuracy"] for s in done) if done else None,
            "accuracy_float32": statistics.mean(runs["float32"][s]["accuracy"] for s in done) if done else None,
            "seeds": done,
            "accuracy_per_seed": [runs[name][s]["accuracy"] for s in done],
            "accuracy_float32_per_seed": [runs["float32"][s]["accuracy"] for s in done],
            "accuracy_curves": [runs[name][s]["accuracy_curve"] for s in done],
            "decode_updates_per_s": decode_aggregate_throughput(name, deltas["cnn"], args.throughput_updates, 5),
            "decode_updates_per_s_wall": decode_aggregate_throughput(name, deltas["cnn"], args.throughput_updates, 5,
                                                                     time.perf_counter),
            "federation_bytes_per_update": fed_bytes,
            "cnn": sizes["cnn"], "mlp1m": sizes["mlp1m"],
        }
        print(f"{name:24s} {rows[name]['bytes_per_param']:.3f} B/param  {rows[name]['compression_ratio']:.1f}x  "
              f"{rows[name]['decode_updates_per_s']:.0f} updates/s", flush=True)
    zstd, verdict = {}, ""
    try:
        import zstandard  # noqa: F401
        for base in ZSTD_PAIRS:
            zstd[base] = compare_zstd(base, deltas["cnn"], args.repeats)
        gain = statistics.median(1 - z["zstd"]["body_bytes"] / z["zlib"]["body_bytes"] for z in zstd.values())
        ms = {m: statistics.median(z[m]["encode_ms"] + z[m]["decode_ms"] for z in zstd.values()) for m in ("zlib", "zstd")}
        verdict = (f"zstd is {100 * gain:+.1f}% smaller than zlib (median over these bodies) and takes "
                   f"{ms['zstd']:.2f} ms instead of {ms['zlib']:.2f} ms to compress and decompress one. "
                   + ("It wins measurably in size: consider adding it to the codec." if gain > 0.03 else
                      "Size, what the uplink pays for, does not differ measurably (< 3%); the time saved is small "
                      "next to a top-k encode, so the codec uses zlib (standard library) only and zstandard is not "
                      "a dependency."))
    except ImportError:
        verdict = "zstandard is not installed; zlib only."
    default, reason = choose_default(rows)
    report = {
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {platform.processor() or ''} Python {platform.python_version()} "
                   f"torch {torch.__version__}",
        "command": "python bench/codec.py " + " ".join(sys.argv[1:]),
        "parameters": params,
        "federation": {"dataset": "mnist5k", "partition": str(PARTITION.relative_to(ROOT)), "algorithm": "fedavg",
                       "clients": len(clients), "seeds": list(seeds), **HP, "rounds": args.rounds},
        "codecs": rows, "flower": FLOWER, "zstd": zstd, "zstd_verdict": verdict,
        "default": default, "default_reason": reason,
    }
    from broker_coordinator.settings.round_settings import RoundSettings
    report["measured_with"] = provenance.measured_with(
        report["command"], {k: v for k, v in provenance.deciding(RoundSettings(algorithm="fedavg")).items()
                            if k not in ("codec", "aggregator", "weighting", "norm_bound")},
        local_epochs=HP["epochs"], aggregator="mean", weighting="reported", norm_bound=0.0,
        varies={"codec": list(rows)}, data="mnist5k", partition=str(PARTITION.relative_to(ROOT)),
        seeds=list(seeds), note="in process: this file's own loop folds with StreamingMean, size-weighted FedAvg")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "codec.json").write_text(json.dumps(report, indent=1))
    (args.out / "codec.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
