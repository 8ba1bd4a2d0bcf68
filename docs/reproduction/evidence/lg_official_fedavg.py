"""Evidence: the official LG-FedAvg FedAvg against our FedAvg cells, round by round.

Reads three groups of runs' test accuracy every round: the official main_fed.py's results.csv
files (lg_official_fedavg.sh; committed as lg_official_fedavg_run*.csv), one of our
lg_table1_cifar10 FedAvg cells (its committed metrics.jsonl, every seed present), and our
FedAvg with the official input pipeline (lg_official_pipeline.sh; committed as
lg_official_pipeline_seed*.csv, the same columns as the official file). Prints, every 200 rounds,
each run's best test accuracy so far and its mean over those 200 rounds, then each run's best.

    python lg_official_fedavg.py [--cell CELL]
    python lg_official_fedavg.py --write-csv RUN_DIR CSV   # a run's metrics.jsonl as an official-style CSV
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from statistics import mean

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


def fmt(values: list[float | None]) -> str:
    return ", ".join("–" if v is None else f"{v:.2f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cell", default="fedavg_2000", help="our lg_table1_cifar10 cell (default fedavg_2000)")
    parser.add_argument("--write-csv", nargs=2, type=Path, metavar=("RUN_DIR", "CSV"))
    args = parser.parse_args()
    if args.write_csv:
        write_csv(*args.write_csv)
        return
    groups = {
        "official": [csv_run(p) for p in sorted(HERE.glob("lg_official_fedavg_run*.csv"))],
        f"ours ({args.cell})": [jsonl_run(p) for p in sorted((RUNS / args.cell).glob("seed*/metrics.jsonl"))],
        "ours, official input pipeline": [csv_run(p) for p in sorted(HERE.glob("lg_official_pipeline_seed*.csv"))],
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


if __name__ == "__main__":
    main()
