"""Evidence: the official LG-FedAvg FedAvg against our FedAvg cells, round by round.

Reads five groups of runs' test accuracy every round: the official main_fed.py's results.csv
files (lg_official_fedavg.sh; committed as lg_official_fedavg_run*.csv), one of our
lg_table1_cifar10 FedAvg cells (lg_ours_CELL_seed*.csv: its runs' metrics.jsonl, which git leaves
on the machine that ran them, written out with --write-csv), our FedAvg
with the official input pipeline (official_pipeline.sh; lg_official_pipeline_seed*.csv, the
same columns as the official file), the official code on our split and client draws
(lg_official_paired.sh; lg_official_paired_seed*.csv) and, with INIT=ours, from our initial
weights too (lg_official_ourinit_seed*.csv). Prints, every 200 rounds, each run's best test
accuracy so far and its mean over those 200 rounds, then each run's best, then the paired groups
minus fedavg_nodecay of the same seed.

    python lg_official_fedavg.py [--cell CELL]
    python lg_official_fedavg.py --write-csv RUN_DIR CSV   # a run's metrics.jsonl as an official-style CSV
    python lg_official_fedavg.py --write-ours CELL         # every seed of one of our cells: lg_ours_CELL_seed*.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path
from math import sqrt
from statistics import mean, stdev

HERE = Path(__file__).resolve().parent
RUNS = HERE.parent / "lg_table1_cifar10" / "runs"


def csv_run(path: Path) -> dict[int, float]:
    """Round (1-based) -> test accuracy (%) of an official-style results.csv."""
    return {int(float(row["epoch"])) + 1: float(row["acc_test"]) for row in csv.DictReader(path.open())}


def jsonl_run(path: Path) -> dict[int, float]:
    """Round -> global test accuracy (%) of one of our runs' metrics.jsonl."""
    return {d["round"]: 100 * d["global_accuracy"] for d in map(json.loads, path.open()) if d.get("phase") == "eval"}


def write_csv(run_dir: Path, out: Path) -> None:
    """Our run's test accuracy every round in the official results.csv's columns (epoch 0-based)."""
    acc = jsonl_run(run_dir / "metrics.jsonl")
    with out.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["epoch", "acc_test"])
        writer.writerows([r - 1, f"{a:.2f}"] for r, a in sorted(acc.items()))


def best_so_far(acc: dict[int, float], rounds: int) -> float | None:
    """The best accuracy over rounds 1..``rounds``, or None if the run stopped before."""
    return max(v for r, v in acc.items() if r <= rounds) if max(acc) >= rounds else None


def window_mean(acc: dict[int, float], first: int, last: int) -> float | None:
    """The mean accuracy over rounds ``first``..``last``, or None if the run stopped before ``last``."""
    return mean(acc[r] for r in range(first, last + 1)) if max(acc) >= last else None


def paired_differences(name: str, pattern: str) -> None:
    """Print, seed by seed, a paired group's runs minus fedavg_nodecay of the same seed."""
    for path in sorted(HERE.glob(pattern)):
        seed = re.search(r"seed(\d+)", path.stem).group(1)
        other, ours = csv_run(path), csv_run(HERE / f"lg_ours_fedavg_nodecay_seed{seed}.csv")
        last = min(max(other), max(ours))
        windows = [(1, 200), (1001, last)] if last > 1000 else [(1, min(200, last))]
        diffs = [best_so_far(other, last) - best_so_far(ours, last)]
        diffs += [window_mean(other, a, b) - window_mean(ours, a, b) for a, b in windows]
        print(f"{name} minus fedavg_nodecay, {path.stem}, {last} rounds: best, "
              + ", ".join(f"mean of rounds {a}-{b}" for a, b in windows)
              + f": {', '.join(f'{d:+.2f}' for d in diffs)}")


def compare_groups(official: list[dict[int, float]], ours: list[dict[int, float]], rounds: int = 1850) -> None:
    """Print two measures over every official-code run that reached ``rounds`` (own or our split,
    own or our initial weights) and every seed of ours: the best over rounds 1..``rounds`` and the
    mean over rounds 1001..``rounds``; means, standard deviations, the difference and its standard
    error (Welch)."""
    measures = {f"best over rounds 1-{rounds}": lambda run: best_so_far(run, rounds),
                f"mean over rounds 1001-{rounds}": lambda run: window_mean(run, 1001, rounds)}
    for name, measure in measures.items():
        a = [v for v in map(measure, official) if v is not None]
        b = [v for v in map(measure, ours) if v is not None]
        diff, se = mean(b) - mean(a), sqrt(stdev(a) ** 2 / len(a) + stdev(b) ** 2 / len(b))
        print(f"{name}: official code, {len(a)} runs, {mean(a):.2f} +- {stdev(a):.2f} ({fmt(a)}); "
              f"ours, {len(b)} seeds, {mean(b):.2f} +- {stdev(b):.2f} ({fmt(b)}); "
              f"ours minus official {diff:+.2f}, standard error {se:.2f} ({diff / se:+.2f} of it)")


def fmt(values: list[float | None]) -> str:
    return ", ".join("–" if v is None else f"{v:.2f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cell", default="fedavg_2000", help="our lg_table1_cifar10 cell (default fedavg_2000)")
    parser.add_argument("--write-csv", nargs=2, type=Path, metavar=("RUN_DIR", "CSV"))
    parser.add_argument("--write-ours", metavar="CELL", help="write lg_ours_CELL_seed*.csv from the cell's runs")
    args = parser.parse_args()
    if args.write_csv:
        write_csv(*args.write_csv)
        return
    if args.write_ours:
        for metrics in sorted((RUNS / args.write_ours).glob("seed*/metrics.jsonl")):
            write_csv(metrics.parent, HERE / f"lg_ours_{args.write_ours}_{metrics.parent.name}.csv")
        return
    groups = {
        "official": [csv_run(p) for p in sorted(HERE.glob("lg_official_fedavg_run*.csv"))],
        f"ours ({args.cell})": [csv_run(p) for p in sorted(HERE.glob(f"lg_ours_{args.cell}_seed*.csv"))],
        "ours, official input pipeline": [csv_run(p) for p in sorted(HERE.glob("lg_official_pipeline_seed*.csv"))],
        "official, our split and clients": [csv_run(p) for p in sorted(HERE.glob("lg_official_paired_seed*.csv"))],
        "official, also our initial weights": [csv_run(p) for p in sorted(HERE.glob("lg_official_ourinit_seed*.csv"))],
    }
    groups = {name: runs for name, runs in groups.items() if runs}
    last = max(max(run) for runs in groups.values() for run in runs)
    print("| rounds | " + " | ".join(f"{name}, best so far" for name in groups) + " | "
          + " | ".join(f"{name}, mean of the 200 rounds" for name in groups) + " |")
    print("|---" * (1 + 2 * len(groups)) + "|")
    for cut in range(200, last + 1, 200):
        best = [fmt([best_so_far(run, cut) for run in runs]) for runs in groups.values()]
        means = [fmt([window_mean(run, cut - 199, cut) for run in runs]) for runs in groups.values()]
        print(f"| {cut} | " + " | ".join(best + means) + " |")
    for name, runs in groups.items():
        print(f"\n{name}, best over each whole run: {fmt([max(run.values()) for run in runs])} "
              f"(rounds {', '.join(str(max(run)) for run in runs)})")
    print()
    official = [run for name, runs in groups.items() if name.startswith("official") for run in runs]
    compare_groups(official, [csv_run(p) for p in sorted(HERE.glob("lg_ours_fedavg_nodecay_seed*.csv"))])
    paired_differences("ours, official input pipeline", "lg_official_pipeline_seed*.csv")
    paired_differences("official, our split and clients", "lg_official_paired_seed*.csv")
    paired_differences("official, also our initial weights", "lg_official_ourinit_seed*.csv")


if __name__ == "__main__":
    main()
