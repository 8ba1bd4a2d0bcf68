"""Evidence: the official FedRep code's Per-FedAvg path against our perfedavg_officialpath cells.

Reads the official main_fedrep.py --alg maml runs (fedrep_official_maml.sh; committed as
fedrep_official_maml_<S>shards_ep<E>*.csv: the mean local test accuracy of every round, and the
'Final Round' line as round 'final') and the fedrep_table1_cifar10 cell of the same setting
(every committed seed; the per-round curve from fedrep_ours_CELL_seed*.csv, a run's metrics.jsonl,
which git leaves on the machine that ran it, written out with --write-ours). Prints, for each, the
two numbers the official script prints ('Average accuracy final 10 rounds' and 'Final Round'),
ours beside them, and both every 10 rounds.

    python fedrep_official_maml.py
    python fedrep_official_maml.py --write-csv LOG CSV   # an official log as such a CSV
    python fedrep_official_maml.py --write-ours CELL     # every seed's curve: fedrep_ours_CELL_seed*.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path
from statistics import mean

HERE = Path(__file__).resolve().parent
RUNS = HERE.parent / "fedrep_table1_cifar10" / "runs"
#: (shards, local epochs) -> our cells of that setting.
CELLS = {(2, 1): ["perfedavg_officialpath_ft_100x2"], (5, 1): ["perfedavg_officialpath_ft_100x5"],
         (5, 5): ["perfedavg_officialpath_ft_ep5_100x5", "perfedavg_officialpath_ft_ep5_nobiasdecay_100x5"]}
ROUND = re.compile(r"^Round +(\d+), Train loss: \S+, Test loss: \S+, Test accuracy: (\S+)")
FINAL = re.compile(r"^Final Round, Train loss: \S+, Test loss: \S+, Test accuracy: (\S+)")


def write_csv(log: Path, out: Path) -> None:
    """The official log's per-round accuracy (rounds 1-based) and its final round, as a CSV."""
    rows = []
    for line in log.open():
        if m := ROUND.match(line):
            rows.append([int(m.group(1)) + 1, m.group(2)])
        elif m := FINAL.match(line):
            rows.append(["final", m.group(1)])
    with out.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["round", "acc_test"])
        writer.writerows(rows)


def write_ours(cell: str) -> None:
    """Each seed's mean local test accuracy every round, from its metrics.jsonl, as a CSV."""
    for metrics in sorted((RUNS / cell).glob("seed*/metrics.jsonl")):
        with (HERE / f"fedrep_ours_{cell}_{metrics.parent.name}.csv").open("w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["round", "acc_test"])
            writer.writerows([d["round"], f"{100 * d['personalized_accuracy']:.4f}"]
                             for d in map(json.loads, metrics.open()) if d.get("phase") == "eval")


def official(path: Path) -> tuple[dict[int, float], float | None]:
    """Round -> accuracy and the final round's accuracy of a committed official CSV."""
    rows = list(csv.DictReader(path.open()))
    final = [float(r["acc_test"]) for r in rows if r["round"] == "final"]
    return {int(r["round"]): float(r["acc_test"]) for r in rows if r["round"] != "final"}, (final or [None])[0]


def ours(cell: str) -> list[tuple[str, dict[int, float], float, float | None]]:
    """(seed, round -> accuracy, final-10-rounds mean, after the final round) of each committed seed."""
    out = []
    for summary in sorted((RUNS / cell).glob("seed*/summary.json")):
        s = json.loads(summary.read_text())
        path = HERE / f"fedrep_ours_{cell}_{summary.parent.name}.csv"
        curve = {int(r["round"]): float(r["acc_test"]) for r in csv.DictReader(path.open())} if path.exists() else {}
        after = s.get("finetune_accuracy_after")
        out.append((summary.parent.name, curve, 100 * s["personalized_accuracy"], None if after is None else 100 * after))
    return out


def fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-csv", nargs=2, type=Path, metavar=("LOG", "CSV"))
    parser.add_argument("--write-ours", metavar="CELL", help="write fedrep_ours_CELL_seed*.csv from the cell's runs")
    args = parser.parse_args()
    if args.write_csv:
        write_csv(*args.write_csv)
        return
    if args.write_ours:
        write_ours(args.write_ours)
        return
    for path in sorted(HERE.glob("fedrep_official_maml_*shards_ep*.csv")):
        shards, epochs = map(int, re.search(r"_(\d+)shards_ep(\d+)", path.name).groups())
        curve, final = official(path)
        last10 = mean(curve[r] for r in range(max(curve) - 9, max(curve) + 1))
        for cell in CELLS[(shards, epochs)]:
            seeds = ours(cell)
            if not seeds:
                continue
            print(f"\n{path.name} ({shards} classes a client, {epochs} local epochs) and {cell}")
            print(f"official: final 10 rounds {last10:.2f}, Final Round {fmt(final)}")
            for seed, _, acc, after in seeds:
                print(f"ours {seed}: final 10 rounds {acc:.2f}, after the final round {fmt(after)}")
            print("| round | official | " + " | ".join(f"ours {seed}" for seed, *_ in seeds) + " |")
            print("|---" * (2 + len(seeds)) + "|")
            for r in range(10, max(curve) + 1, 10):
                print(f"| {r} | {curve[r]:.2f} | " + " | ".join(fmt(c.get(r)) for _, c, *_ in seeds) + " |")
    paired_table()


def paired_table() -> None:
    """The 5-epoch setting, round by round: the official code on its own split and clients
    (fedrep_official_maml_5shards_ep5*.csv, and shorter runs fedrep_official_maml_ep5_*.csv), on
    a seed of ours' split, clients or both, or on none of them as a control
    (fedrep_official_paired_ep5_*.csv, fedrep_official_paired.sh DRAWS) and that seed of ours
    (perfedavg_officialpath_ft_ep5_100x5)."""
    runs = {path.stem.removeprefix("fedrep_official_"): official(path)[0] for pattern in
            ("fedrep_official_maml_5shards_ep5*.csv", "fedrep_official_maml_ep5_*.csv", "fedrep_official_paired_ep5_*.csv")
            for path in sorted(HERE.glob(pattern))}
    seeds = {int(m.group(1)) for name in runs if (m := re.search(r"paired_ep5_seed(\d+)", name))}
    for seed, curve, *_ in ours(CELLS[(5, 5)][0]):
        if int(seed.removeprefix("seed")) in seeds:
            runs[f"ours {seed}"] = curve
    if not seeds:
        return
    print("\n5 local epochs: the official code on its own draws (maml_*) and through the paired copy (paired_*)")
    print("| round | " + " | ".join(runs) + " |")
    print("|---" * (1 + len(runs)) + "|")
    for r in range(10, max(max(c) for c in runs.values()) + 1, 10):
        print(f"| {r} | " + " | ".join(fmt(c.get(r)) for c in runs.values()) + " |")
    print("| mean of rounds 31-40 | " + " | ".join(fmt(window_mean(c, 31, 40)) for c in runs.values()) + " |")


def window_mean(curve: dict[int, float], first: int, last: int) -> float | None:
    """The mean accuracy of rounds first..last, where the curve has every one of them."""
    rounds = range(first, last + 1)
    return mean(curve[r] for r in rounds) if all(r in curve for r in rounds) else None


if __name__ == "__main__":
    main()
