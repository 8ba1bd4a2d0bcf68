"""Record, or check against a record, the metrics of the quickstart and of a 3-round tiny run
of every algorithm and paper protocol, run in-process through the real ServerApp/ClientApp.

A refactoring that must not change any number is checked with it:

    python tests/behaviour_baseline.py record docs/behaviour-baseline   # before
    python tests/behaviour_baseline.py check docs/behaviour-baseline    # after: exit 1 on any difference

Timings (elapsed and wall seconds, eNTK speeds) are left out of the comparison; every other
value of every ``metrics.jsonl`` record and of ``summary.json`` must be equal: numbers within a
relative 1e-4 (another CPU may sum in another order: small training losses then differ by up to
2e-6; a changed behaviour moves them far more), everything else exactly.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED_DATASETS = ROOT.parent / "shared" / "datasets"
if SHARED_DATASETS.is_dir():  # the data home of the recorded cases (docs/data.md)
    os.environ.setdefault("FLREP_DATA", str(SHARED_DATASETS))

TINY = ("wandb.enabled=false compare=[] data.num_clients=6 train.fraction=0.5 rounds=3 eval.every=1 "
        "eval.final_window=2 fedrep.head_epochs=2")
#: name -> (experiment, overrides)
CASES: dict[str, tuple[str, str]] = {
    "quickstart": ("quickstart", "wandb.enabled=false"),
    "fedavg": ("quickstart", f"{TINY} algorithm=fedavg"),
    "fedavg-ft": ("quickstart", f"{TINY} algorithm=fedavg finetune.enabled=true finetune.epochs=2"),
    "fedavg-fedadam": ("quickstart", f"{TINY} algorithm=fedavg server_opt.name=fedadam server_opt.lr=0.01"),
    "fedprox": ("quickstart", f"{TINY} algorithm=fedprox fedprox.mu=0.1"),
    "scaffold-ft": ("quickstart", f"{TINY} algorithm=scaffold finetune.enabled=true finetune.epochs=2 finetune.part=full"),
    "fedrep-newclients": ("quickstart", f"{TINY} algorithm=fedrep data.num_clients=8 data.num_new_clients=2 "
                                        "new_clients.epochs=2"),
    "fedper": ("quickstart", f"{TINY} algorithm=fedper"),
    "lg_fedavg": ("quickstart", f"{TINY} algorithm=lg_fedavg lg.fedavg_rounds=1 lg.global_part=[fc2] new_test.enabled=true"),
    "lg_fedavg-online": ("quickstart", f"{TINY} algorithm=lg_fedavg lg.fedavg_rounds=1 lg.global_part=[fc2] rounds=2 "
                                       "new_test.enabled=true "
                                       "data.online_device.enabled=true data.online_device.train_size=100 "
                                       "data.online_device.test_size=30 online.rounds=2 online.fraction=0.4"),
    "local_only": ("quickstart", f"{TINY} algorithm=local_only new_test.enabled=true"),
    "tct": ("quickstart", f"{TINY} algorithm=tct tct.stage1_rounds=1 tct.features=64 tct.local_steps=2 rounds=3"),
    "local_update-adam": ("quickstart", f"{TINY} algorithm=local_update local_update.steps=3 server_opt.name=adam "
                                        "server_opt.lr=0.01"),
    "local_update-maml": ("quickstart", f"{TINY} algorithm=local_update local_update.preset=maml local_update.steps=2"),
    "linear_fedrep": ("linear_fedrep", "wandb.enabled=false compare=[] rounds=3 data.num_clients=10 "
                                       "eval.final_window=2"),
    "lg_fair_adult": ("lg_fair_adult", "wandb.enabled=false compare=[] rounds=3 lg.fedavg_rounds=1 new_test.enabled=true "
                                       "data.num_clients=4 train.fraction=0.5 eval.final_window=2 "
                                       "fair.pretrain_epochs=1 fair.postfit_epochs=1 train.local_epochs=1"),
}
TIMING_KEYS = {"elapsed_s", "wall_time_s", "wall_time_per_round_s", "convexify_seconds", "entk_client_seconds_max", "entk_samples_per_s",
               "tct_convexify_seconds", "tct_entk_samples_per_s", "out_dir", "timings", "started_at", "startup_s",
               "total_time_s", "source"}


def _clean(value):
    """``value`` without timing keys (recursively)."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def run_case(experiment: str, overrides: str, out: Path) -> dict:
    """Run one case in-process into ``out``; its cleaned records and summary."""
    from flower_app.run.config import load_variants
    from flower_app.app.server_app import run_variants
    from tests.local_grid import LocalGrid

    overrides = f"{overrides} out_dir={out}"
    variants = load_variants(experiment, overrides.split())
    grid = LocalGrid(int(variants[0].data.num_clients), {"experiment": experiment, "overrides": overrides})
    run_variants(grid, variants)
    result = {}
    for metrics in sorted(out.rglob("metrics.jsonl")):
        rel = str(metrics.parent.relative_to(out))
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        summary = json.loads((metrics.parent / "summary.json").read_text())
        result[rel] = {"records": _clean(records), "summary": _clean(summary)}
    return result


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("record", "check"):
        print(__doc__)
        return 2
    mode, folder = argv[0], Path(argv[1])
    names = argv[2:] or list(CASES)
    folder.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in names:
        experiment, overrides = CASES[name]
        tmp = Path(tempfile.mkdtemp(prefix=f"baseline-{name}-"))
        try:
            result = run_case(experiment, overrides, tmp / "run")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        path = folder / f"{name}.json"
        if mode == "record":
            path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
            print(f"recorded {name}")
            continue
        expected = json.loads(path.read_text())
        now = json.loads(json.dumps(result, sort_keys=True))
        if same(expected, now):
            print(f"same     {name}")
        else:
            failed.append(name)
            print(f"DIFFERS  {name}: {_first_difference(expected, now)}")
    return 1 if failed else 0


REL_TOL = 1e-4  # numbers closer than this are the same number summed in another order (seen: 2e-6)


def same(a, b) -> bool:
    """Whether two JSON values are equal, numbers within ``REL_TOL`` (bools and None exactly)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b))
    return a == b


def _first_difference(a, b, path: str = "") -> str:
    """Where two JSON values first differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}/{key}: only in {'recorded' if key in a else 'now'}"
            if not same(a[key], b[key]):
                return _first_difference(a[key], b[key], f"{path}/{key}")
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            if not same(x, y):
                return _first_difference(x, y, f"{path}[{i}]")
    return f"{path}: recorded {a!r}, now {b!r}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
