"""Every result says what it was measured with, and the docs say only what the results hold.

(a) every JSON in bench/results carries `measured_with` with a commit and a command;
(b) a file that claims to describe the defaults (`"describes": "defaults"` in its `measured_with`,
    or named, by file name or make target, in a sentence or table row of README.md / docs/*.md that
    says "default") was measured with today's `bench.provenance.defaults()` on every key both carry;
(c) every number of docs/RESULTS.md, docs/OPERATOR.md's "what to expect" table and docs/PRIVACY.md's
    "Choosing the numbers" matches the results file its claim links (CLAIMS below, and the table
    tests after them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.provenance import defaults
from edgefl_protocol import codec

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
FILES = sorted(RESULTS.glob("*.json"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_result_says_what_it_was_measured_with(path):
    measured = json.loads(path.read_text()).get("measured_with")
    assert isinstance(measured, dict), f"{path.name} has no top-level measured_with (see bench/provenance.py)"
    assert measured.get("commit") and measured.get("command"), f"{path.name}: measured_with needs commit and command"


# --- (b) files that claim to describe the defaults --------------------------------------------

def units(text: str) -> list[tuple[str, str]]:
    """(claim, what it is about): sentences of paragraphs and list items, each about itself, and
    table rows, each about itself and the caption above the table (which names the file)."""
    out, caption = [], ""
    for block in re.split(r"\n\s*\n|\n(?=\s*(?:[-*] |\d+\. |#))", text):  # paragraphs, list items, headings
        if block.lstrip().startswith("|"):
            out += [(row, row + " " + caption) for row in block.splitlines()]
        else:
            caption = " ".join(block.split())
            out += [(u, u) for u in re.split(r"(?<=[.!?])\s+(?=[A-Z*`(\[])", caption)]
    return out


def names(unit: str, stem: str) -> bool:
    return bool(re.search(rf"(?<![\w-]){re.escape(stem)}\.(json|md|png)\b", unit)
                or re.search(rf"make {re.escape(stem.replace('_', '-'))}(?![\w-])", unit))


def claims_defaults(path: Path) -> list[str]:
    """Where `path` is said to describe the defaults: its own measured_with, or doc sentences."""
    where = ["its measured_with"] if json.loads(path.read_text()).get("measured_with", {}).get(
        "describes") == "defaults" else []
    for doc in DOCS:
        for unit, about in units(doc.read_text()):
            if "default" in unit.lower() and names(about, path.stem):
                where.append(f"{doc.relative_to(ROOT)}: {unit.strip()[:160]}")
    return where


def same(key: str, theirs, ours, measured: dict) -> bool:
    """A named codec is today's "auto" where auto resolves to it on every model the file measured."""
    if key == "codec" and ours == codec.AUTO and theirs != ours and measured.get("model_values"):
        return all(codec.resolve(codec.AUTO, n) == theirs for n in measured["model_values"])
    return theirs == ours


@pytest.mark.parametrize("path", [p for p in FILES if claims_defaults(p)], ids=lambda p: p.name)
def test_a_file_that_claims_the_defaults_was_measured_with_them(path):
    measured, today = json.loads(path.read_text())["measured_with"], defaults()
    differ = {k: (measured[k], today[k]) for k in sorted(set(measured) & set(today))
              if not same(k, measured[k], today[k], measured)}
    assert not differ, (
        f"{path.name} is said to describe the defaults ({claims_defaults(path)[0]}) but was measured with "
        + ", ".join(f"{k}={theirs!r} (today {ours!r})" for k, (theirs, ours) in differ.items())
        + f"; rerun it: {measured['command']}")


# --- (c) the numbers the docs quote -------------------------------------------------------------

def at(data, path: str):
    for key in path.split("/"):
        data = data[int(key)] if isinstance(data, list) else data[key]
    return data


KIB = 1 / 1024
# (doc, claim text with the quoted number as its group, file, JSON path, scale, decimals)
MOMENTUM_ROW = "1000of10000, server momentum 0.9, serve_average 0.5"
DENSE_ROW = "1000of10000, float32 uploads, server momentum 0.9, serve_average 0.5"  # the same with float32 uploads  # privacy.json's 1000of10000 row with server momentum

RESULTS_PAGE = "docs/RESULTS.md"
PRIVACY_ROW = {"top-k": MOMENTUM_ROW, "float32": DENSE_ROW}
EPSILONS = ("none", "8", "3", "1")


def row(label: str, column: int, number: str = r"[\d.]+") -> str:
    """The `column`th cell (0 = the first after the label) of the RESULTS.md table row `label`, as the group."""
    return r"\| " + label + r" \| " + r"[^|]*\| " * column + "(" + number + ")"


CLAIMS = [
    # the across-settings choice table is checked cell by cell by test_the_choice_table_is_field_json
    (RESULTS_PAGE, row(r"`dynsam\+sgd`", 1), "field.json", "default_final_mean", 1, 2),
    (RESULTS_PAGE, r"`dynsam\+sgd` ends ([\d.]+) points above FedAvg with SGD", "field.json", "default_vs_fedavg", 1, 1),
    (RESULTS_PAGE, row("`dynsam`", 0), "algorithms.json", "headline_mean/dynsam", 100, 2),
    (RESULTS_PAGE, row("`dynsam`", 1, r"[+-][\d.]+"), "algorithms.json", "headline_vs/dynsam/fedavg", 100, 2),
    (RESULTS_PAGE, row("`dynsam`", 2, r"[+-][\d.]+"), "algorithms.json", "headline_vs/dynsam/fedsmoo", 100, 2),
    (RESULTS_PAGE, r"within ([\d.]+) points of clean", "attacks.json", "clean_minus_sign_flip@0.1", 100, 1),
    *[(RESULTS_PAGE, row(f"10 of 20, {label}", i), "privacy.json", f"runs/10of20/{eps}/final_accuracy/{i}", 100, 2)
      for label, eps in (("no privacy", "none"), ("epsilon 8", "8")) for i in range(3)],
    *[(RESULTS_PAGE, row(rf"server momentum 0\.9, `serve_average = 0\.5`, {uplink} uploads", i), "privacy.json",
       f"runs/{PRIVACY_ROW[uplink]}/{eps}/final_accuracy_mean", 100, 2)
      for uplink in ("top-k", "float32") for i, eps in enumerate(EPSILONS)],
    *[(RESULTS_PAGE, row("the same with the PLD accountant", i), "privacy.json",
       f"runs/{DENSE_ROW}, PLD accountant/{eps}/final_accuracy_mean", 100, 2) for i, eps in enumerate(EPSILONS)],
    *[(RESULTS_PAGE, row(r"no server momentum, `serve_average = 0\.5`, top-k uploads", i), "privacy.json",
       f"runs/1000of10000, serve_average 0.5/{eps}/final_accuracy_mean", 100, 2) for i, eps in enumerate(EPSILONS)],
    (RESULTS_PAGE, r"pooled data reaches ([\d.]+)%", "privacy.json", "central_reference/accuracy", 100, 2),
    (RESULTS_PAGE, r"takes ([\d.]+)x the time without DP", "privacy.json", "round_seconds/ratio", 1, 2),
    (RESULTS_PAGE, row("x86 under a Pi 4's quota", 2), "dp_sgd_cost.json", "models/mnist_cnn/ratio", 1, 2),
    (RESULTS_PAGE, row("Pi 4, emulated", 2), "pi_dp_sgd.json", "pis/pi4/mnist_cnn/ratio", 1, 2),
    (RESULTS_PAGE, row("Pi 5, emulated", 2), "pi_dp_sgd.json", "pis/pi5/mnist_cnn/ratio", 1, 2),
    *[(RESULTS_PAGE, row("signed updates/s into one coordinator", i, r"\d+"), "runtime.json", f"updates_per_s/{n}", 1, 0)
      for i, n in enumerate(("100", "300", "1000"))],
    *[(RESULTS_PAGE, row("updates per second of the coordinator's own CPU", i, r"\d+"), "runtime.json",
       f"scale/{i}/updates_per_coordinator_cpu_s_median", 1, 0) for i in range(3)],
    *[(RESULTS_PAGE, row(r"coordinator peak RSS \(MB\)", i, r"\d+"), "runtime.json", f"coordinator_rss_mb/{n}", 1, 0)
      for i, n in enumerate(("100", "300", "1000"))],
    *[(RESULTS_PAGE, row("central broker, MB a round", i), "scale.json", f"central_bytes_per_round/{topology}", 1e-6, 1)
      for i, topology in enumerate(("flat", "tree"))],
    (RESULTS_PAGE, r"\| (\d+)x fewer bytes", "scale.json", "ratio_flat_over_tree", 1, 0),
    (RESULTS_PAGE, r"in every round \| \| \+(\d+)%", "scale.json", "tree_growth_low_to_high", 100, 0),
    *[(RESULTS_PAGE, row(r"coordinator CPU per update \(ms\)", i), "scale.json",
       f"coordinator_cpu_s_per_update/{topology}", 1000, 2) for i, topology in enumerate(("flat", "tree"))],
    *[(RESULTS_PAGE, row(r"the same without the round's central evaluation \(ms\)", i), "scale.json",
       f"coordinator_cpu_s_per_update_without_evaluation/{topology}", 1000, 2)
      for i, topology in enumerate(("flat", "tree"))],
    (RESULTS_PAGE, r"read time against 1,000 files \| \| \| ([\d.]+)x", "spool.json", "ratio_last_to_first", 1, 2),
    (RESULTS_PAGE, row("`fedavg`", 2) + "x", "buffered.json", "speedup_median", 1, 1),
    (RESULTS_PAGE, row("`dynsam`", 2) + "x", "buffered_dynsam.json", "speedup_median", 1, 2),
    (RESULTS_PAGE, r"\| `dynsam` \| ([\d.]+), [\d.]+ \|", "buffered_dynsam.json", "seeds/1/sync_final_accuracy", 1, 2),
    (RESULTS_PAGE, r"\| `dynsam` \| [\d.]+, ([\d.]+) \|", "buffered_dynsam.json", "seeds/2/sync_final_accuracy", 1, 2),
    (RESULTS_PAGE, r"\| `dynsam` \|[^\n]*x \| \+([\d.]+),", "buffered_dynsam.json", "seeds/1/final_gap", 1, 2),
    (RESULTS_PAGE, row("KB down a client-round, controlled runs", 0, r"\d+"), "downlink_controlled.json", "float32/down", KIB, 0),
    (RESULTS_PAGE, row("KB down a client-round, controlled runs", 1, r"\d+"), "downlink_controlled.json", "delta/down", KIB, 0),
    (RESULTS_PAGE, row("KB down a client-round, field runs", 0, r"\d+"), "downlink.json", "float32/down", KIB, 0),
    (RESULTS_PAGE, row("KB down a client-round, field runs", 1, r"\d+"), "downlink.json", "delta/down", KIB, 0),
    (RESULTS_PAGE, r"points lost to the deltas, controlled runs \| \| ([\d.]+)", "downlink_controlled.json",
     "points_lost/final_accuracy", 1, 2),
    (RESULTS_PAGE, row("every cell", 1, r"\d+"), "composition.json", "cells_ok", 1, 0),
    (RESULTS_PAGE, row("the pairwise subset", 1, r"\d+"), "composition_pairwise.json", "cells_ok", 1, 0),
    (RESULTS_PAGE, row("the pairwise subset", 2, r"\d+") + " of the 96", "composition_pairwise.json", "refused_count", 1, 0),
    (RESULTS_PAGE, r"\| (\d+) of \d+ \| \d+ \| \d+ \|", "fault_drill.json", "rounds_finished", 1, 0),
    (RESULTS_PAGE, r"\| \d+ of \d+ \| (\d+) \| \d+ \|", "fault_drill.json", "updates_trained", 1, 0),
    (RESULTS_PAGE, r"\| \d+ of \d+ \| \d+ \| (\d+) \|", "fault_drill.json", "outcomes/accepted", 1, 0),
    (RESULTS_PAGE, r"\(`stale`\) \| (\d+) \|", "fault_drill.json", "lost_without_reason", 1, 0),
    (RESULTS_PAGE, row(r"release to current on every device, median \(s\)", 0), "serving.json",
     "release_to_current_s/median_all_devices", 1, 2),
    (RESULTS_PAGE, row(r"prediction latency p50 / p99 while idle \(ms\)", 0), "serving.json", "latency_ms/idle/p50", 1, 2),
    (RESULTS_PAGE, row(r"prediction latency p50 / p99 while training \(ms\)", 0), "serving.json",
     "latency_ms/training/p50", 1, 2),
    (RESULTS_PAGE, row("torn or partial reads in 1,000 swaps", 0, r"\d+"), "serving.json", "torn_or_partial", 1, 0),
    (RESULTS_PAGE, row("gate decisions that served a model worse than the margin", 0, r"\d+"), "serving.json",
     "gate/served_worse_than_margin", 1, 0),
    (RESULTS_PAGE, row(r"serving bytes per device per day at the paced defaults \(MB\)", 0), "serving.json",
     "serving_bytes_per_device_day", 1e-6, 2),
    *[(RESULTS_PAGE, row(label, i), "serving.json", f"serving_mean/{block}/{key}", 100, 2)
      for label, key in (("the global served model", "global"), ("personalized: the device's label prior", "personalized"),
                         ("personalized: 60 SGD steps", "tuned"), ("what the gate served", "served"))
      for i, block in enumerate(("local_accuracy", "local_test_accuracy"))],
    (RESULTS_PAGE, row("upgraded while running", 0, r"\d+"), "upgrade.json", "rounds_completed", 1, 0),
    (RESULTS_PAGE, row("upgraded while running", 1, r"\d+"), "upgrade.json", "rounds_repeated", 1, 0),
    (RESULTS_PAGE, row("upgraded while running", 2, r"\d+"), "upgrade.json", "rounds_skipped", 1, 0),
    (RESULTS_PAGE, row("upgraded while running", 3, r"\d+"), "upgrade.json", "updates_lost_with_reason", 1, 0),
    (RESULTS_PAGE, row("upgraded while running", 4, r"\d+"), "upgrade.json", "updates_lost_without_reason", 1, 0),
    (RESULTS_PAGE, row("upgraded while running", 5), "upgrade.json", "final_accuracy", 100, 2),
    (RESULTS_PAGE, row(r"never upgraded \(0\.1\.0 throughout\)", 5), "upgrade.json", "final_accuracy_never_upgraded",
     100, 2),
    ("docs/PRIVACY.md", r"non-private run ends at \*\*([\d.]+)%", "privacy.json",
     f"runs/{MOMENTUM_ROW}/none/final_accuracy_mean", 100, 2),
    *[("docs/PRIVACY.md", r"private ones at \*\*" + r"[\d.]+ / " * i + r"([\d.]+)", "privacy.json",
       f"runs/{MOMENTUM_ROW}/{eps}/final_accuracy_mean", 100, 2) for i, eps in enumerate(("8", "3", "1"))],
    *[("docs/PRIVACY.md", pattern, "privacy.json", f"runs/{DENSE_ROW}/{eps}/final_accuracy_mean", 100, 2)
      for pattern, eps in ((r"end at \*\*([\d.]+)%\*\* without privacy and", "none"),
                           (r"without privacy and\s+\*\*([\d.]+) /", "8"), (r"without privacy and\s+\*\*[\d.]+ / ([\d.]+) /", "3"),
                           (r"without privacy and\s+\*\*[\d.]+ / [\d.]+ / ([\d.]+)%", "1"))],
    ("docs/PRIVACY.md", r"scores ([\d.]+)% after one epoch", "privacy.json", "central_reference/accuracy", 100, 2),
    ("docs/OPERATOR.md", r"10 agents \(median of rounds 2-5\) \| ([\d.]+)", "runtime.json", "overhead_ratio/10", 1, 3),
    ("docs/OPERATOR.md", r"same, 50 agents \| ([\d.]+)", "runtime.json", "overhead_ratio/50", 1, 3),
    ("docs/OPERATOR.md", r"10 / 50 agents \| ([\d.]+) /", "runtime.json",
     "overhead/0/overhead_ratio_with_eval_and_checkpoint", 1, 3),
    ("docs/OPERATOR.md", r"10 / 50 agents \| [\d.]+ / ([\d.]+)", "runtime.json",
     "overhead/1/overhead_ratio_with_eval_and_checkpoint", 1, 3),
    ("docs/OPERATOR.md", r"updates/s .*devices \| (\d+) /", "runtime.json", "updates_per_s/100", 1, 0),
    ("docs/OPERATOR.md", r"updates/s .*devices \| \d+ / (\d+) /", "runtime.json", "updates_per_s/300", 1, 0),
    ("docs/OPERATOR.md", r"updates/s .*devices \| \d+ / \d+ / (\d+)", "runtime.json", "updates_per_s/1000", 1, 0),
    ("docs/OPERATOR.md", r"coordinator's own CPU, .*devices \| (\d+) /", "runtime.json",
     "scale/0/updates_per_coordinator_cpu_s_median", 1, 0),
    ("docs/OPERATOR.md", r"coordinator's own CPU, .*devices \| \d+ / (\d+) /", "runtime.json",
     "scale/1/updates_per_coordinator_cpu_s_median", 1, 0),
    ("docs/OPERATOR.md", r"coordinator's own CPU, .*devices \| \d+ / \d+ / (\d+)", "runtime.json",
     "scale/2/updates_per_coordinator_cpu_s_median", 1, 0),
    ("docs/OPERATOR.md", r"peak RSS, .*devices \| (\d+) /", "runtime.json", "coordinator_rss_mb/100", 1, 0),
    ("docs/OPERATOR.md", r"peak RSS, .*devices \| \d+ / (\d+) /", "runtime.json", "coordinator_rss_mb/300", 1, 0),
    ("docs/OPERATOR.md", r"peak RSS, .*devices \| \d+ / \d+ / (\d+)", "runtime.json", "coordinator_rss_mb/1000",
     1, 0),
    ("docs/OPERATOR.md", r"MNIST CNN\) \| ([\d.]+)", "runtime.json", "agent_rss_ratio", 1, 2),
    ("docs/OPERATOR.md", r"MNIST CNN\) \| [\d.]+ \((\d+) /", "runtime.json", "agent_footprint/agent_peak_rss_mb", 1, 0),
    ("docs/OPERATOR.md", r"MNIST CNN\) \| [\d.]+ \(\d+ / (\d+) MB", "runtime.json",
     "agent_footprint/bare_torch_rss_mb", 1, 0),
]
def headline_mean(d: dict, row: str) -> float:
    """algorithms.json, field.json: a row's final accuracy on the headline setting, mean over its seeds."""
    final = d["settings"]["mnist5k_dirichlet0.1_20clients"][row]["final_accuracy"]
    return sum(final) / len(final)


DERIVED = {  # numbers the docs quote that the files hold only in parts
    **{f"field_mean/{row}": (lambda d, row=row: headline_mean(d, row))
       for row in ("fedavg+momentum", "dynsam+sgd", "fedsmoo+sgd", "fedsam+momentum", "fedavg+sgd")},
    # "all N cells": N ok, and no cell that was not
    "cells_ok": lambda d: sum(c["ok"] for c in d["cells"]) if all(c["ok"] for c in d["cells"]) else -1,
    "refused_count": lambda d: len(d["refused"]),
    "torn_or_partial": lambda d: d["swaps"]["torn_reads"] + d["swaps"]["partial_reads"],
    **{f"serving_mean/{block}/{key}": (lambda d, block=block, key=key: sum(d[block][key]) / len(d[block][key]))
       for block in ("local_accuracy", "local_test_accuracy") for key in ("global", "personalized", "tuned", "served")},
    "default_final_mean": lambda d: sum(d["fleet"]["runs"]["dynsam+sgd"]["final_accuracy"]) / 2,
    "default_vs_fedavg": lambda d: (sum(d["fleet"]["runs"]["dynsam+sgd"]["final_accuracy"])
                                    - sum(d["fleet"]["runs"]["fedavg+sgd"]["final_accuracy"])) / 2,
    "headline_mean/dynsam": lambda d: headline_mean(d, "dynsam"),
    "headline_vs/dynsam/fedavg": lambda d: headline_mean(d, "dynsam") - headline_mean(d, "fedavg"),
    "headline_vs/dynsam/fedsmoo": lambda d: headline_mean(d, "dynsam") - headline_mean(d, "fedsmoo"),
}
SECTIONS = {RESULTS_PAGE: None, "docs/OPERATOR.md": "## Running on a real fleet: what to expect",
            "docs/PRIVACY.md": "## Choosing the numbers"}  # None: the whole page


def section(doc: str) -> str:
    text = (ROOT / doc).read_text()
    if SECTIONS[doc] is None:
        return text
    start = text.index(SECTIONS[doc])
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


@pytest.mark.parametrize("doc,pattern,name,path,scale,decimals", CLAIMS, ids=[c[1][:40] for c in CLAIMS])
def test_the_docs_quote_their_results_file(doc, pattern, name, path, scale, decimals):
    text = section(doc)
    found = re.search(pattern, text)
    assert found, f"{doc}: no claim matching {pattern!r} any more (update CLAIMS in tests/test_provenance.py)"
    blocks = re.split(r"\n\s*\n", text[:found.end()])
    context = "\n".join(blocks[-2:]) if blocks[-1].lstrip().startswith("|") else blocks[-1]
    context += text[found.end():].split("\n\n")[0]
    assert f"bench/results/{name}" in context, f"{doc}: the claim {found.group(0)!r} does not link {name}"
    data = load(name)
    value = DERIVED[path](data) if path in DERIVED else at(data, path)
    assert float(found.group(1)) == round(value * scale, decimals), (
        f"{doc} says {found.group(1)} ({found.group(0)!r}); {name} {path} gives {round(value * scale, decimals)}")


def test_the_choice_table_is_field_json():
    """RESULTS.md's across-settings table: each cell "final (margin)" is field.json's mean over the seeds and
    its difference from FedAvg with the same client optimizer; the worst margin and the passes alike."""
    text = section(RESULTS_PAGE)
    table = text[text.index("The choice: final accuracy %"):].split("\n\n")[1]
    data = load("field.json")["settings"]
    settings = ["mnist5k_dirichlet0.1_20clients", "synthetic1,1_30clients", "digits_shards2_20clients"]
    checked = 0
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        row = re.match(r"`([^`]+)`", cells[0]).group(1)
        margins = []
        for setting, cell in zip(settings, cells[1:4]):
            final, margin = map(float, re.fullmatch(r"([\d.]+) \(([+-][\d.]+)\)", cell).groups())
            mine = data[setting][row]["final_accuracy"]
            fedavg = data[setting]["fedavg+" + row.split("+")[1]]["final_accuracy"]
            assert final == round(sum(mine) / len(mine), 2), f"RESULTS.md: {row} on {setting} says {final}"
            assert margin == round(sum(mine) / len(mine) - sum(fedavg) / len(fedavg), 2), (row, setting, margin)
            margins.append(margin)
        assert float(cells[4]) == pytest.approx(min(margins), abs=0.011), f"RESULTS.md: {row}'s worst case"
        passes = max(data[s][row]["passes_vs_fedavg"] for s in settings)
        assert cells[5] == f"{passes:.2f}x", f"RESULTS.md: {row}'s passes say {cells[5]}, field.json {passes:.2f}x"
        checked += 1
    assert checked >= 5


def test_the_attack_table_is_attacks_json():
    """RESULTS.md's MNIST attack table: each cell "mean (worse seed against absent), ASR low-high%" is attacks.json's."""
    text = section(RESULTS_PAGE)
    table = text[text.index("MNIST: final accuracy, mean of the seeds"):].split("\n\n")[1]
    runs = load("attacks.json")["runs"]["mnist5k_dirichlet0.5_20clients"]
    folds = ["centered_clip", "centered_clip+flags2", "centered_clip+root", "mean"]
    checked = 0
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        run = cells[0]
        for fold, cell in zip(folds, cells[1:]):
            if cell == "-":
                assert fold not in runs[run], f"RESULTS.md: {run} under {fold} is in attacks.json"
                continue
            found = re.fullmatch(r"([\d.]+)(?: \(([+-]?[\d.]+)\))?(?:, ASR (\d+)(?:-(\d+))?%)?", cell)
            assert found, f"RESULTS.md: {run} under {fold}: {cell!r}"
            accuracy = runs[run][fold]["final_accuracy"]
            assert float(found[1]) == round(100 * sum(accuracy) / len(accuracy), 2), (run, fold, cell)
            if found[2] is not None:
                absent = runs["absent@" + run.split("@")[1]][fold]["final_accuracy"]
                worst = round(100 * max(a - b for a, b in zip(absent, accuracy)), 1)
                assert float(found[2]) == pytest.approx(-worst, abs=1e-9), (run, fold, cell, -worst)
            if found[3] is not None:
                success = runs[run][fold]["attack_success"]
                assert (int(found[3]), int(found[4] or found[3])) == (round(100 * min(success)), round(100 * max(success)))
            checked += 1
    assert checked >= 40
