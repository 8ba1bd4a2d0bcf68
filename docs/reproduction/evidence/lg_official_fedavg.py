"""Evidence: the official LG-FedAvg FedAvg against our fedavg_nodecay cell, round by round.

Reads the official main_fed.py's results.csv (from lg_official_fedavg.sh; committed as
lg_official_fedavg_run1.csv) and our three committed fedavg_nodecay runs' metrics.jsonl, and
prints each one's best test accuracy so far every 200 rounds and the mean over the last 200 rounds
both reached. Usage: python lg_official_fedavg.py [RESULTS_CSV]
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = HERE.parent / "lg_table1_cifar10" / "runs" / "fedavg_nodecay"


def best_so_far(acc: dict[int, float], rounds: int) -> float:
    """The best accuracy over rounds 1..``rounds``."""
    return max(v for r, v in acc.items() if r <= rounds)


def main() -> None:
    results = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "lg_official_fedavg_run1.csv"
    official = {int(float(row["epoch"])) + 1: float(row["acc_test"]) for row in csv.DictReader(results.open())}
    ours = [{d["round"]: 100 * d["global_accuracy"] for d in map(json.loads, (RUNS / f"seed{s}" / "metrics.jsonl").open())
             if d.get("phase") == "eval"} for s in range(3)]
    last = max(official)
    print("| rounds | official, best so far | ours, seeds 0, 1, 2 | ours, mean |")
    print("|---|---|---|---|")
    for cut in [*range(200, last + 1, 200), *([last] if last % 200 else [])]:
        b = [best_so_far(run, cut) for run in ours]
        print(f"| {cut} | {best_so_far(official, cut):.2f} | {', '.join(f'{x:.2f}' for x in b)} | {sum(b) / 3:.2f} |")
    first = max(1, last - 199)
    means = [sum(acc[r] for r in range(first, last + 1)) / (last - first + 1) for acc in (official, *ours)]
    print(f"\nmean test accuracy over rounds {first}-{last}: official {means[0]:.2f}; "
          f"ours {', '.join(f'{m:.2f}' for m in means[1:])}")


if __name__ == "__main__":
    main()
