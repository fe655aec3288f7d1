"""The cross-settings field report (bench/field_settings.py): rows per setting from the cached runs,
the default chosen by its worst case across the settings, the issue's targets, and the markdown."""

from __future__ import annotations

import statistics

from .field_report import mean

MAX_PASSES = 1.3  # a candidate makes at most this many of FedAvg's local passes, on every setting
STABLE_WITHIN = 1.0  # points: no row's final accuracy this far below its own best, in any seed
# A run evaluates its last global model (the coordinator's `accuracy`) and, beside it, the served moving
# average of the global models (`ema_accuracy`; bench/fedsim.py), which never feeds back into training. The
# rows score what the shipped coordinator serves: the average at the default decay, or the last model.


def row_key(record: dict) -> str:
    client = "momentum" if record["momentum"] else "sgd"
    server = record.get("deciding", {}).get("server_optimizer", "sgd")
    return f"{record['variant']}+{client}" + ("" if server == "sgd" else f"+{server}")


def served_curve(record: dict, decay: float) -> list[float]:
    """A run's accuracy per round of the model a coordinator with `serve_average = decay` serves."""
    if decay == 0:
        return record["accuracy"]
    if f"{decay:g}" not in record.get("ema_accuracy", {}):
        raise ValueError(f"run {record.get('setting')}/{record.get('variant')} seed {record.get('seed')} has no "
                         f"served average at decay {decay:g}: rerun it (python -m bench.field_settings)")
    return record["ema_accuracy"][f"{decay:g}"]


def client_of(row: str) -> str:
    return row.split("+")[1]


def shipped_row(shipped) -> str:
    """The row a coordinator with these `RoundSettings` runs, e.g. `dynsam+sgd`."""
    return f"{shipped.algorithm}+{'momentum' if shipped.momentum else 'sgd'}" + (
        "" if shipped.server_optimizer == "sgd" else f"+{shipped.server_optimizer}")


def algorithm_of(row: str) -> str:
    """The algorithm a row runs: `dynsam-leaky+sgd` is `dynsam` with an option."""
    return row.split("+")[0].split("-")[0]


def honest_weights(runs: list[dict]) -> dict[str, float]:
    """Every device of these runs is honest: the share of their updates the fold weighed below full weight
    (or left out), and the least weight one kept, from the rounds' device records."""
    shares = [0.0 if "left_out" in m else float(str(m.get("weight_share", "1")).split()[0])
              for r in runs for rnd in r["signals"] for m in rnd.values() if "passes" in m]
    if not shares:
        return {}
    return {"honest_down_weighted": round(sum(x < 1 for x in shares) / len(shares), 4),
            "honest_min_weight": min(shares)}


def summarize(records: list[dict], decay: float | None = None) -> dict[str, dict[str, dict]]:
    """{setting: {row: final and best accuracy per seed (%), the worst final-minus-best, passes}}, scoring the
    model served at `serve_average = decay` (None: the shipped coordinator's)."""
    grouped: dict[str, dict[str, list[dict]]] = {}
    for r in sorted(records, key=lambda r: r["seed"]):
        grouped.setdefault(r["setting"], {}).setdefault(row_key(r), []).append(r)
    table: dict[str, dict[str, dict]] = {}
    if decay is None:
        from broker_coordinator.settings.round_settings import RoundSettings
        decay = RoundSettings().serve_average  # the rows score what the shipped coordinator serves
    for setting, rows in sorted(grouped.items()):
        out = table.setdefault(setting, {})
        for row, runs in sorted(rows.items()):
            curves = [served_curve(r, decay) for r in runs]
            finals = [round(100 * c[-1], 2) for c in curves]
            bests = [round(100 * max(c), 2) for c in curves]
            passes = mean([mean([m["passes"] for rnd in r["signals"] for m in rnd.values() if "passes" in m])
                           for r in runs])
            last = [r["accuracy"] for r in runs]
            out[row] = {**honest_weights(runs), "seeds": [r["seed"] for r in runs], "final_accuracy": finals,
                        "best_accuracy": bests,
                        "final_minus_best_worst": round(min(f - b for f, b in zip(finals, bests)), 2),
                        "passes": round(passes, 2), "commits": sorted({r.get("commit", "?") for r in runs}),
                        # the last global model (what the coordinator served before serve_average = 0.75)
                        "last_model_final": [round(100 * c[-1], 2) for c in last],
                        "last_model_final_minus_best_worst": round(min(100 * (c[-1] - max(c)) for c in last), 2)}
        for row, value in out.items():
            ref = out.get(f"fedavg+{client_of(row)}")
            value["passes_vs_fedavg"] = round(value["passes"] / ref["passes"], 3) if ref else None
    return table


def choose(table: dict[str, dict[str, dict]], settings: list[str], seeds: int) -> dict:
    """The row with the best worst case across `settings`: the smallest over the settings of its mean final
    accuracy minus FedAvg's (same client optimizer), among rows with every seed on every setting and at
    most MAX_PASSES x FedAvg's passes on each. Also every candidate's margins, so the table can show why."""
    margins: dict[str, dict[str, float]] = {}
    for row in sorted(set.intersection(*(set(table.get(s, {})) for s in settings)) if settings else []):
        per = {}
        for s in settings:
            value, ref = table[s][row], table[s].get(f"fedavg+{client_of(row)}")
            if len(value["seeds"]) < seeds or not ref or len(ref["seeds"]) < seeds:
                break
            if value["passes_vs_fedavg"] is None or value["passes_vs_fedavg"] > MAX_PASSES:
                break
            per[s] = round(mean(value["final_accuracy"]) - mean(ref["final_accuracy"]), 2)
        else:
            margins[row] = per
    if not margins:
        return {"row": None, "why": "no row has every seed on every setting yet", "margins": {}}
    best = max(margins, key=lambda r: (min(margins[r].values()), mean(list(margins[r].values()))))
    return {"row": best, "worst_case_vs_fedavg": min(margins[best].values()), "margins": margins,
            "rule": f"best worst case over {', '.join(settings)} of (mean final - FedAvg's, same client "
                    f"optimizer), {seeds} seeds, at most {MAX_PASSES}x FedAvg's passes on every setting"}


def targets(table: dict[str, dict[str, dict]], row: str, headline: str) -> list[str]:
    lines = []
    for setting, rows in table.items():
        if row in rows and f"fedavg+{client_of(row)}" in rows:
            gap = mean(rows[row]["final_accuracy"]) - mean(rows[f"fedavg+{client_of(row)}"]["final_accuracy"])
            need = 2.0 if setting == headline else 0.0
            lines.append(f"- {setting}: {row} vs fedavg+{client_of(row)}: {gap:+.2f} points "
                         f"(target >= +{need:.1f}): **{'met' if gap >= need else 'missed'}**")
    head = table.get(headline, {})
    others = {r: v for r, v in head.items() if r != row}  # FedAvg's rows too: with a server optimizer it can lead
    # the best other row, and the best row of another algorithm (not a variant of the default's own)
    for label, rivals in (("the best other row", others),
                          ("the best other algorithm", {r: v for r, v in others.items()
                                                        if algorithm_of(r) != algorithm_of(row)})):
        if row in head and rivals:
            rival = max(rivals, key=lambda r: mean(rivals[r]["final_accuracy"]))
            gap = mean(head[row]["final_accuracy"]) - mean(rivals[rival]["final_accuracy"])
            lines.append(f"- {headline}: vs {label} {rival}: {gap:+.2f} points (target >= +0.5): "
                         f"**{'met' if gap >= 0.5 else 'missed'}**")
    for setting, rows in table.items():
        unstable = sorted((v["final_minus_best_worst"], r) for r, v in rows.items()
                          if v["final_minus_best_worst"] < -STABLE_WITHIN)
        own = rows.get(row, {}).get("final_minus_best_worst")
        lines.append(f"- {setting}: {len(unstable)} of {len(rows)} rows end more than {STABLE_WITHIN:g} point below "
                     f"their own best in some seed" + (f" (worst: {unstable[0][1]} {unstable[0][0]:+.2f})" if unstable
                                                       else "")
                     + (f"; {row}: {own:+.2f}" if own is not None else "")
                     + f" (target: none): **{'missed' if unstable else 'met'}**")
    return lines


def _fmt(values: list[float]) -> str:
    return f"{mean(values):.2f} +- {statistics.stdev(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def markdown(table: dict[str, dict[str, dict]], choice: dict, settings: list[str], measured: dict) -> str:
    from broker_coordinator.settings.round_settings import RoundSettings
    shipped = RoundSettings()
    runtime_row = shipped_row(shipped)
    intro = ("`python -m bench.field_settings` (bench/field_settings.py): the shipped engine in process "
             "(bench/inmemory.py), the default codec, fold and device-chosen epochs on the demo's fleet mix "
             f"with a {measured['round_timeout']:g} s deadline; final accuracy in % of the served model (the "
             f"average of the global models, decay {shipped.serve_average:g}), mean +- std over the seeds; the "
             "last global model's beside it. "
             f"Runs from commits {', '.join(measured['run_commits'])}.")
    lines = ["# The default across settings", "", intro, ""]
    for setting in settings:
        rows = table.get(setting, {})
        header = ("| row | seeds | final | best | final - best (worst seed) | passes vs fedavg "
                  "| last global model: final | its final - best (worst seed) |")
        lines += [f"## {setting}", "", header, "|---|---|---|---|---|---|---|---|"]
        for row in sorted(rows, key=lambda r: -mean(rows[r]["final_accuracy"])):
            v = rows[row]
            lines.append(f"| {row} | {','.join(map(str, v['seeds']))} | {_fmt(v['final_accuracy'])} | "
                         f"{_fmt(v['best_accuracy'])} | {v['final_minus_best_worst']:+.2f} | "
                         f"{v['passes_vs_fedavg'] if v['passes_vs_fedavg'] is not None else '-'}x | "
                         + f"{_fmt(v['last_model_final'])} | {v['last_model_final_minus_best_worst']:+.2f} |")
        lines.append("")
    lines += ["## The choice", "", f"Rule: {choice.get('rule', choice.get('why'))}.", ""]
    if choice["margins"]:
        lines += ["| row | " + " | ".join(settings) + " | worst |", "|---|" + "---|" * (len(settings) + 1)]
        for row, per in sorted(choice["margins"].items(), key=lambda kv: -min(kv[1].values())):
            lines.append(f"| {row} | " + " | ".join(f"{per[s]:+.2f}" for s in settings) + f" | {min(per.values()):+.2f} |")
        chosen = (f"Chosen: **{choice['row']}** (worst case {choice['worst_case_vs_fedavg']:+.2f} points "
                  f"against FedAvg). Shipped default: `{runtime_row}`.")
        lines += ["", chosen, ""]
    lines += [f"Targets for the shipped default `{runtime_row}`:", ""]
    lines += targets(table, runtime_row, settings[0])
    return "\n".join(lines) + "\n"
