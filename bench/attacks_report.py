"""bench/results/attacks.json, attacks.md and attacks.png from the cached runs of `bench.attacks`."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from . import provenance

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = RESULTS / "attacks_runs"
# name -> overrides. The default fold serves the average of the global models (serve_average = 0.75);
# the rows marked LAST serve the last global model, as every row did before that was the default
LAST = {"serve_average": 0.0}
FOLDS: dict[str, dict] = {"centered_clip": {}, "mean": {"aggregator": "mean"},
                         "centered_clip+serve0": LAST, "mean+serve0": {"aggregator": "mean", **LAST},
                         "geomed": {"aggregator": "geomed", **LAST},
                         "trimmed_mean": {"aggregator": "trimmed_mean", **LAST},
                         "median": {"aggregator": "median", **LAST},
                         # the default fold with the sign-vote stage (aggregation/votes.py): a coordinate moves only
                         # where 40% of the round's updates agree on its sign
                         "centered_clip+votes": {"sign_quorum": 0.4, **LAST},
                         # the same, serving today's default average of the global models
                         "centered_clip+votes+serve0.75": {"sign_quorum": 0.4},
                         # the default fold with its opt-in kinship flag (aggregation/consensus.py)
                         "centered_clip+kinship0.4": {"kinship": 0.4, **LAST},
                         # the round's flags reach its own updates (aggregation/banks.py), with and without kinship
                         "centered_clip+banks8": {"verdict_banks": 8, **LAST},
                         "centered_clip+banks8+kinship0.4": {"verdict_banks": 8, "kinship": 0.4, **LAST},
                         # the agreement stage flags only median cosines below -0.05 (aggregation/consensus.py)
                         "centered_clip+floor0.05": {"agreement_floor": 0.05, **LAST},
                         # a device's weight falls from its second flag in its last 5 judged updates
                         "centered_clip+flags2": {"agreement_flags": 2},
                         # the default fold serving a slower average (research/served_decay.py: fewer late declines)
                         "centered_clip+serve0.9": {"serve_average": 0.9},
                         # the default fold weighing each update by its cosine with the coordinator's own update on
                         # ROOT_SAMPLES clean examples ([fold] root_trust, FLTrust)
                         "centered_clip+root": {"root_trust": True}}
HEADLINE = "mnist5k_dirichlet0.5_20clients"
SECOND = "synthetic1,1_30clients"
SECOND_ATTACKS = ("sign_flip", "reversed", "backdoor", "adaptive")
SITES = 4
ROOT_SAMPLES = 200  # root_trust's clean set: drawn from the honest devices' pooled data, never the test set
ROUND_TIMEOUT = 6.0  # the demo's deadline (bench/algorithms.py): it caps the device-chosen epochs


def run_key(partition: str, run: str, fold: str, seed: int, rounds: int) -> str:
    return f"{partition}__{run.replace('/', '-')}__{fold}__s{seed}__r{rounds}"

DEFAULT_FOLD = "centered_clip"
ROOT_FOLD = "centered_clip+root"
EARLY = range(2, 6)  # the rounds whose served model the early gap compares
# the rows the grid runs; FOLDS' other rows are research variants, measured with the agreement stage of an
# earlier release (docs/RESEARCH.md) and run again only when named (--folds)
GRID = ("centered_clip", "centered_clip+flags2", "centered_clip+root", "centered_clip+votes", "mean", "mean+serve0", "geomed", "trimmed_mean",
        "median")
CUT = (f"the second partition ({SECOND}) runs clean, absent@0.1 and {', '.join(SECOND_ATTACKS)} at 10% only, "
       "flat only; 10 rounds on the headline partition, with the MLP (not the issue's 25 with the CNN); sites only on the headline partition (clean and one "
       "compromised site of 4); geomed, trimmed_mean and median (they hold the round) on the headline only, 7 runs")


def _cell(records: list[dict]) -> dict:
    cell = {"final_accuracy": [r["final_accuracy"] for r in records],
            "seeds": [r["seed"] for r in records],
            "attacker_updates_folded": sum(r["attacker_updates_folded"] for r in records),
            "attacker_updates_sent": sum(r["attacker_updates_sent"] for r in records),
            "honest_left_out": (sum(r["honest_left_out"] for r in records)
                                / max(1, sum(r["honest_updates"] for r in records)))}
    if any("attack_success" in r for r in records):
        cell["attack_success"] = [r.get("attack_success") for r in records]
    if any("forged_partials" in r for r in records):
        cell["forged_partials"] = sum(r.get("forged_partials", 0) for r in records)
    cell["clipped"] = {k: sum(r["clipped"].get(k, 0) for r in records) for r in records for k in r["clipped"]}
    if all("honest_down_weighted" in r for r in records):  # runs made before the share was recorded have none
        honest = sum(r["honest_updates"] for r in records)
        cell["honest_down_weighted"] = (sum(r["honest_down_weighted"] * r["honest_updates"] for r in records)
                                        / max(1, honest))
        cell["honest_min_weight"] = min(r["honest_min_weight"] for r in records)
    return cell


def early_gap(attacked: list[dict], clean: list[dict]) -> float | None:
    """Points: the largest clean-minus-attacked served accuracy over rounds EARLY, the worst seed (None
    without the clean run of a seed)."""
    by_seed = {r["seed"]: r["accuracy"] for r in clean}
    gaps = [100 * (by_seed[r["seed"]][i - 1] - r["accuracy"][i - 1]) for r in attacked if r["seed"] in by_seed
            for i in EARLY if i <= len(r["accuracy"])]
    return max(gaps) if gaps else None


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def targets(runs: dict, fold: str = DEFAULT_FOLD) -> dict:
    """The issue's targets for `fold` (the default fold unless named), each with what was measured (points)
    and whether met."""
    out = {}
    head = runs.get(HEADLINE, {})
    for key, cells in head.items():
        attack, _, frac = key.partition("@")
        if key.startswith(("sites/", "absent", "clean")) or fold not in cells:
            continue
        absent = head.get(f"absent@{frac}", {}).get(fold)
        if not absent:
            continue
        worst = max(100 * (a - b) for a, b in zip(absent["final_accuracy"], cells[fold]["final_accuracy"]))
        limit = 1.0 if frac == "0.1" else 3.0
        out[f"{key} within {limit:g} of absent"] = {"worst_points_below": round(worst, 2), "met": worst <= limit}
        if attack == "backdoor":
            success = max(cells[fold]["attack_success"])
            limit = 0.1 if frac == "0.1" else 0.2
            out[f"{key} success <= {limit:g}"] = {"worst": round(success, 4), "met": success <= limit}
    second = runs.get(SECOND, {})
    for key, cells in second.items():
        attack, _, frac = key.partition("@")
        absent = second.get(f"absent@{frac}", {}).get(fold)
        if key.startswith(("absent", "clean")) or fold not in cells or not absent:
            continue
        worst = max(100 * (a - b) for a, b in zip(absent["final_accuracy"], cells[fold]["final_accuracy"]))
        out[f"{SECOND} {key} within 2 of absent"] = {"worst_points_below": round(worst, 2), "met": worst <= 2.0}
    for key, cells in head.items():
        if key.endswith("@0.2") and not key.startswith("absent") and "early_gap" in cells.get(fold, {}):
            gap = cells[fold]["early_gap"]
            out[f"{key} early gap <= 5"] = {"worst_points": round(gap, 2), "met": gap <= 5.0}
    # the plain mean serving the same model where it ran (mean+serve0 for folds serving the last model), else
    # the shipped one
    mean = "mean+serve0" if FOLDS.get(fold, {}).get("serve_average") == 0 else "mean"
    for partition in (HEADLINE, SECOND):
        clean = runs.get(partition, {}).get("clean", {})
        if fold in clean and mean in clean:
            gap = 100 * (_mean(clean[mean]["final_accuracy"]) - _mean(clean[fold]["final_accuracy"]))
            out[f"{partition} clean within 0.5 of mean"] = {"points_below": round(gap, 2), "met": gap <= 0.5}
            left = clean[fold]["honest_left_out"]
            out[f"{partition} clean honest left out <= 5%"] = {"fraction": left, "met": left <= 0.05}
        if "honest_down_weighted" in clean.get(fold, {}):
            share, least = clean[fold]["honest_down_weighted"], clean[fold]["honest_min_weight"]
            out[f"{partition} clean honest down-weighted <= 2%"] = {"fraction": round(share, 4), "met": share <= 0.02}
            out[f"{partition} clean honest weight >= 0.6"] = {"least": round(least, 3), "met": least >= 0.6}
    site = head.get("sites/compromised_site@0.25", {}).get(fold)
    tree = head.get("sites/clean", {}).get(fold)
    if site and tree:
        worst = max(100 * (a - b) for a, b in zip(tree["final_accuracy"], site["final_accuracy"]))
        out["one compromised site of 4 within 2 of the clean tree"] = {"worst_points_below": round(worst, 2),
                                                                      "met": worst <= 2.0}
    return out


def report(jobs: list[tuple], folds: list[str]) -> dict:
    from broker_coordinator.settings.round_settings import RoundSettings

    grouped: dict = {}
    for job in jobs:
        path = RUNS / f"{run_key(*job)}.json"
        if path.exists():
            partition, run, fold, _, _ = job
            grouped.setdefault(partition, {}).setdefault(run, {}).setdefault(fold, []).append(
                json.loads(path.read_text()))
    runs = {p: {run: {fold: _cell(rs) for fold, rs in cells.items()} for run, cells in by_run.items()}
            for p, by_run in grouped.items()}
    for p, by_run in grouped.items():
        for run, cells in by_run.items():
            clean = by_run.get("sites/clean" if run.startswith("sites/") else "clean", {})
            for fold, records in cells.items():
                gap = early_gap(records, clean.get(fold, [])) if "clean" not in run else None
                if gap is not None:
                    runs[p][run][fold]["early_gap"] = gap
    commits = sorted({r["commit"] for by_run in grouped.values() for cells in by_run.values()
                      for rs in cells.values() for r in rs})
    stages = ("sign_quorum", "kinship", "verdict_banks", "agreement_floor", "serve_average", "root_trust")  # FOLDS vary
    rows = [RoundSettings(**FOLDS[f]) for f in folds]
    settings = {k: v for k, v in provenance.deciding(RoundSettings()).items()
                if k not in ("aggregator", "topology", *stages)}
    out = {"measured_with": provenance.measured_with(
        provenance.invoked(), settings, describes="defaults",
        varies={"aggregator": [provenance.deciding(r)["aggregator"] for r in rows],
                **{k: [getattr(r, k) for r in rows] for k in stages},
                "topology": ["flat", "sites"]},
        codec_per_model=provenance.codecs_of(["mnist_mlp", "logreg60"]),
        run_commits=commits, partitions=[HEADLINE, SECOND], seeds=sorted({j[3] for j in jobs}),
        rounds=sorted({j[4] for j in jobs}), clients_per_round=10, round_timeout=ROUND_TIMEOUT,
        fleet="the demo's mix (bench/algorithms.py fleet_for)", sites=SITES, cut=CUT,
        note="in process through bench/inmemory.py (the agent's training, codec, signing) and the shipped "
             "intake and fold; sites through SiteWorker and fold_partials; no broker"),
        "default_fold": DEFAULT_FOLD, "runs": runs}
    out["targets"] = targets(runs)
    if any(ROOT_FOLD in cells for cells in runs.get(HEADLINE, {}).values()):
        out["targets_root_trust"] = targets(runs, ROOT_FOLD)
    # the same targets for every fold that ran every run: how many each holds
    out["targets_held"] = {f: f"{sum(t['met'] for t in held.values())} of {len(held)}"
                           for f in folds if len(held := targets(runs, f)) == len(out["targets"])}
    head_clean = runs.get(HEADLINE, {}).get("clean", {}).get(DEFAULT_FOLD)
    sign = runs.get(HEADLINE, {}).get("sign_flip@0.1", {}).get(DEFAULT_FOLD)
    if head_clean and sign:  # what README quotes
        out["clean_minus_sign_flip@0.1"] = _mean(head_clean["final_accuracy"]) - _mean(sign["final_accuracy"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "attacks.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / "attacks.md").write_text(markdown(out, folds))
    plot(out, folds)
    return out


def markdown(out: dict, folds: list[str]) -> str:
    mw = out["measured_with"]
    lines = [f"# Attacks on what ships: final accuracy (%), mean of seeds {mw['seeds']}", "",
             (f"Written by `{mw['command']}` ({', '.join(mw['run_commits'])}). {mw['rounds']} rounds, 10 devices a "
             f"round, dynsam with device-chosen epochs ({mw['round_timeout']:g} s deadline, demo fleet), the default "
             "codec and every coordinator default but the fold. In brackets: against `absent` at the same fraction "
             "(flat) or the clean tree (sites). folded/sent: the attackers' updates folded in / sent; "
             "ASR: backdoor success on stamped test images of classes 1-9."), f"Cut to fit an hour: {CUT}.", ""]
    for partition, by_run in out["runs"].items():
        lines += [f"## {partition}", "", "| run | " + " | ".join(folds) + " |", "|---|" + "---:|" * len(folds)]
        for run, cells in by_run.items():
            frac = run.partition("@")[2]
            base = by_run.get("sites/clean" if run.startswith("sites/") else f"absent@{frac}", {})
            row = []
            for fold in folds:
                cell = cells.get(fold)
                if cell is None:
                    row.append("-")
                    continue
                acc = 100 * _mean(cell["final_accuracy"])
                text = f"{acc:.2f}"
                if fold in base and run not in ("clean", "sites/clean") and not run.startswith("absent"):
                    text += f" ({acc - 100 * _mean(base[fold]['final_accuracy']):+.1f})"
                if "attack_success" in cell:
                    text += f", ASR {100 * _mean(cell['attack_success']):.1f}%"
                if cell["attacker_updates_sent"]:
                    text += f", {cell['attacker_updates_folded']}/{cell['attacker_updates_sent']}"
                if cell["honest_left_out"]:
                    text += f", {100 * cell['honest_left_out']:.1f}% honest left out"
                row.append(text)
            lines.append(f"| {run} | " + " | ".join(row) + " |")
        lines.append("")
    lines += _honest_and_early(out, folds)
    for title, key in (("default fold", "targets"), (f"`{ROOT_FOLD}`: the default fold with root_trust", "targets_root_trust")):
        if key not in out:
            continue
        lines += [f"## Targets ({title}, both seeds)", "", "| target | measured | met |", "|---|---:|---|"]
        for name, t in out[key].items():
            value = next(v for k, v in t.items() if k != "met")
            lines.append(f"| {name} | {value} | {'yes' if t['met'] else '**no**'} |")
        lines.append("")
    lines += ["", "Targets held by each fold that ran every run (the same targets on its own cells; the clean gap "
              "to the plain mean serving the same model: `mean+serve0` for folds serving the last model, else `mean`):", "",
              "| fold | held |", "|---|---|"] + [f"| {f} | {h} |" for f, h in out.get("targets_held", {}).items()]
    return "\n".join(lines) + "\n"


def _honest_and_early(out: dict, folds: list[str]) -> list[str]:
    """What each fold costs honest devices in clean runs, and how far 20% attackers put the served model
    below the clean run's over rounds 2-5 (points, the worst seed)."""
    lines = ["## Honest devices in clean runs, and the first rounds under 20% attackers", "",
             "down-weighted: the share of honest updates folded below their full weight; least: the smallest "
             "weight an honest update kept (0 = left out). Early gap: clean minus attacked served accuracy, the "
             "largest over rounds 2-5; absent@0.2's (no attacker, a fifth of the devices gone) is what losing "
             "their data and changing the cohorts costs by itself.", ""]
    head = out["runs"].get(HEADLINE, {})
    early = sorted((run for run in head if run.endswith("@0.2") and not run.startswith("sites/")),
                   key=lambda run: not run.startswith("absent"))
    lines += ["| fold | " + " | ".join(f"{p[:9]} clean: down-weighted, least" for p in out["runs"])
              + " | " + " | ".join(f"early gap {run}" for run in early) + " |",
              "|---|" + "---:|" * (len(out["runs"]) + len(early))]
    for fold in folds:
        row = []
        for partition in out["runs"]:
            cell = out["runs"][partition].get("clean", {}).get(fold, {})
            row.append(f"{100 * cell['honest_down_weighted']:.1f}%, {cell['honest_min_weight']:.2f}"
                       if "honest_down_weighted" in cell else "-")
        row += [f"{head[run][fold]['early_gap']:.1f}" if "early_gap" in head[run].get(fold, {}) else "-"
                for run in early]
        lines.append(f"| {fold} | " + " | ".join(row) + " |")
    return lines + [""]


def plot(out: dict, folds: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head = out["runs"].get(HEADLINE, {})
    if not head:
        return
    names = list(head)
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(names)), 4.5))
    width = 0.8 / len(folds)
    for k, fold in enumerate(folds):
        xs = [i + k * width for i, run in enumerate(names) if fold in head[run]]
        ys = [100 * _mean(head[run][fold]["final_accuracy"]) for run in names if fold in head[run]]
        ax.bar(xs, ys, width, label=fold)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("final accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"{HEADLINE}: attacks on what ships (mean of seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "attacks.png", dpi=110)
    plt.close(fig)
