"""Record, or check against a record, the metrics of the quickstart and of a 3-round tiny run
of every algorithm and paper protocol, run in-process through the real ServerApp/ClientApp.

A refactoring that must not change any number is checked with it:

    python tests/behaviour_baseline.py record docs/behaviour-baseline   # before
    python tests/behaviour_baseline.py check docs/behaviour-baseline    # after: exit 1 on any difference

Whether an earlier commit's code gives the numbers of now (the seeds of a reproduction's primary
may span such commits; flower_app/reproduction/code_versions.py):

    python tests/behaviour_baseline.py same-numbers cd512d5 ce9f468     # writes docs/reproduction/same_numbers.json
    python tests/behaviour_baseline.py same-numbers --cases lg_fair_adult cd512d5   # a case redefined since

Timings (elapsed and wall seconds, eNTK speeds) are left out of the comparison; every other
value of every ``metrics.jsonl`` record and of ``summary.json`` must be equal: numbers within a
relative 1e-4, everything else exactly.

The script runs every case on the portable x86 kernels (``KERNELS``: ATen's default kernels, MKL's
COMPATIBLE branch, oneDNN's SSE4.1 code), which give the same sums on every x86 CPU. With each CPU's
own kernels, records made on one machine failed on another: two cases moved by more than 1e-4
(``l2gd``'s loss after a near-divergent round, ``cnn-crop_flip``'s accuracy on 20 test samples).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED_DATASETS = ROOT.parent / "shared" / "datasets"
#: the kernels every case runs on: the same sums on every x86 CPU (set before torch is imported)
KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"}
if SHARED_DATASETS.is_dir():  # the data home of the recorded cases (docs/data.md)
    os.environ.setdefault("FLREP_DATA", str(SHARED_DATASETS))

TINY = ("wandb.enabled=false compare=[] data.num_clients=6 train.fraction=0.5 rounds=3 eval.every=1 "
        "eval.final_window=2 fedrep.head_epochs=2")
CNN = ("wandb.enabled=false compare=[] data.num_clients=5 train.fraction=0.4 rounds=3 eval.every=1 eval.final_window=2 "
       "model.name=lenet5 model.output=logits train.augment=crop_flip new_test.enabled=false fedrep.head_epochs=2")
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
    "ditto": ("quickstart", f"{TINY} algorithm=ditto"),
    "apfl": ("quickstart", f"{TINY} algorithm=apfl"),
    "l2gd": ("quickstart", f"{TINY} algorithm=l2gd"),
    "fed_mtl": ("quickstart", f"{TINY} algorithm=fed_mtl"),
    "perfedavg": ("quickstart", f"{TINY} algorithm=perfedavg"),
    "local_from_average": ("quickstart", f"{TINY} algorithm=local_from_average"),
    "fedbabu": ("quickstart", f"{TINY} algorithm=fedbabu"),
    "fedrod": ("quickstart", f"{TINY} algorithm=fedrod"),
    "fedbn": ("quickstart", f"{TINY} algorithm=fedbn model.name=digits_mlp_bn train.fraction=1.0"),
    "pfedme": ("quickstart", f"{TINY} algorithm=pfedme"),
    "fedala": ("quickstart", f"{TINY} algorithm=fedala"),
    "fedproto": ("quickstart", f"{TINY} algorithm=fedproto"),
    "fedamp": ("quickstart", f"{TINY} algorithm=fedamp"),
    "feddbe": ("quickstart", f"{TINY} algorithm=feddbe"),
    # a convolutional model with on-device crop + flip (as the CIFAR tables run), on MNIST: 15-25 s each
    "cnn-crop_flip": ("lg_mnist", f"{CNN} algorithm=fedavg"),
    "fedrep-cnn-crop_flip": ("lg_mnist", f"{CNN} algorithm=fedrep"),
    "linear_fedrep": ("linear_fedrep", "wandb.enabled=false compare=[] rounds=3 data.num_clients=10 "
                                       "eval.final_window=2"),
    # lambda 1, not the paper's 30: at 30 the adversarial game turns another CPU's 1e-7 rounding into points of
    # accuracy by round 3; at 1 another BLAS code path moves no number by more than 3e-6
    "lg_fair_adult": ("lg_fair_adult", "wandb.enabled=false compare=[] rounds=3 lg.fedavg_rounds=1 new_test.enabled=true "
                                       "data.num_clients=4 train.fraction=0.5 eval.final_window=2 "
                                       "fair.pretrain_epochs=1 fair.postfit_epochs=1 train.local_epochs=1 "
                                       "fair.lambdas=[1.0,1.0]"),
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


def unknown_cases(names: list[str]) -> str | None:
    """What is wrong with ``names`` when some are not cases; None when all are."""
    unknown = sorted(set(names) - set(CASES))
    return f"no case {', '.join(unknown)}; the cases are {', '.join(CASES)}" if unknown else None


def main(argv: list[str]) -> int:
    if argv and argv[0] == "same-numbers":
        return same_numbers(argv[1:])
    if len(argv) < 2 or argv[0] not in ("record", "check"):
        print(__doc__)
        return 2
    mode, folder = argv[0], Path(argv[1])
    names = argv[2:] or list(CASES)
    if unknown := unknown_cases(names):
        print(f"{mode}: {unknown}")
        return 2
    folder.mkdir(parents=True, exist_ok=True)
    print(f"kernels: {kernels()}", flush=True)
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
            print(f"DIFFERS  {name}: {difference(expected, now)}")
    return 1 if failed else 0


REL_TOL = 1e-4  # numbers closer than this are the same number summed in another order (seen: 2e-6)


def same(a, b) -> bool:
    """Whether two JSON values are equal, numbers within ``REL_TOL`` (bools and None exactly)."""
    return not difference(a, b)


def difference(a, b, path: str = "", exact: bool = False) -> str:
    """Where two JSON values first differ ("" when they do not). By default (``check``) numbers within
    ``REL_TOL`` are equal and a key that one side lacks is a difference. ``exact`` (two runs on one machine,
    ``same-numbers``): numbers exactly (a tolerance would hide a change as small as the warm-start leak of
    85fe1a3, 1e-7 in a 3-round case and whole points in a 100-round run), and a key only one side reports (a
    metric added or renamed since) is none."""
    then = "then" if exact else "now"
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) & set(b) if exact else set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}/{key}: only in {'recorded' if key in a else then}"
            where = difference(a[key], b[key], f"{path}/{key}", exact)
            if where:
                return where
        return ""
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            where = difference(x, y, f"{path}[{i}]", exact)
            if where:
                return where
        return ""
    return "" if _equal(a, b, exact) else f"{path}: recorded {a!r}, {then} {b!r}"


def _equal(a, b, exact: bool) -> bool:
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        if math.isnan(a) and math.isnan(b):
            return True
        return a == b if exact else math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-12)
    return a == b


# Run in a child process whose first path is a commit's tree: that commit's own run_case, on the cases of now.
AT_COMMIT = """
import json, sys, tempfile, traceback
from pathlib import Path
tree, cases, out = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
sys.path.insert(0, tree)
import tests.behaviour_baseline as then
results = {}
for name, (experiment, overrides) in cases.items():
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results[name] = {"result": then.run_case(experiment, overrides, Path(tmp) / "run")}
    except BaseException as error:
        results[name] = {"error": (traceback.format_exception_only(error)[-1]).strip()[:300]}
    print(name, "ran" if "result" in results[name] else "did not run", flush=True)
out.write_text(json.dumps(results))
"""


def app_modules(root: Path) -> list[str]:
    """The app's own modules under ``root`` that a run can execute (the packages whose source a run records;
    not the reproduction tables' code, which runs them from another process), relative paths."""
    from flower_app.results.provenance import PACKAGES
    found = (p.relative_to(root).as_posix() for package in PACKAGES for p in (root / package).rglob("*.py"))
    return sorted(p for p in found if not p.startswith("flower_app/reproduction/"))


def outputs_in(tree: Path, cases: dict[str, tuple[str, str]] | None = None) -> dict[str, dict]:
    """The ``cases`` of now (default: every one) run in a child process with the code of ``tree``:
    ``{case: {"result": ...}}`` or ``{case: {"error": ...}}``."""
    with tempfile.TemporaryDirectory(prefix="same-numbers-out-") as tmp:
        out = Path(tmp) / "outputs.json"
        chosen = CASES if cases is None else cases
        subprocess.run([sys.executable, "-c", AT_COMMIT, str(tree), json.dumps(chosen), str(out)], cwd=tree,
                       env={**os.environ, "PYTHONPATH": str(tree)}, check=False)
        return json.loads(out.read_text()) if out.is_file() else {}


def outputs_at(rev: str, cases: dict[str, tuple[str, str]] | None = None) -> dict[str, dict]:
    """:func:`outputs_in` the tree of commit ``rev`` (a temporary worktree)."""
    with tempfile.TemporaryDirectory(prefix="same-numbers-") as tmp:
        tree = Path(tmp) / "tree"
        if SHARED_DATASETS.parent.is_dir():  # where a commit's experiments look for the offline data: ../shared
            (Path(tmp) / "shared").symlink_to(SHARED_DATASETS.parent)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(tree), rev], check=True)
        try:
            return outputs_in(tree, cases)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def short_commit(rev: str) -> str:
    """The 7-digit commit id of ``rev`` in this repository."""
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", rev], capture_output=True,
                          text=True, check=True).stdout.strip()


def output_digests(outputs: dict[str, dict]) -> dict[str, str]:
    """``{case: sha256 (16 hex digits) of its cleaned numbers}`` of the cases that ran."""
    return {name: hashlib.sha256(json.dumps(_clean(out["result"]), sort_keys=True).encode()).hexdigest()[:16]
            for name, out in outputs.items() if "result" in out}


def kernels() -> str:
    """The CPU kernels torch runs in this process: ATen's, and the MKL and oneDNN settings."""
    import torch

    return (f"ATen {torch.backends.cpu.get_cpu_capability()}, MKL_CBWR={os.environ.get('MKL_CBWR', 'unset')}, "
            f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')}")


def machine() -> str:
    """The CPU model, torch version and kernels: numbers compare exactly only on one machine."""
    import platform

    import torch

    info = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in (info.read_text().splitlines() if info.is_file() else [])
              if line.startswith("model name")]
    return f"{models[0] if models else platform.processor()}, torch {torch.__version__}, {kernels()}"


def same_numbers(args: list[str]) -> int:
    """Compare each commit's numbers on the cases of now with those of the code now, both run here (numbers
    drift across machines); record it (code_versions). ``--cases A,B REV ...`` checks those cases alone (a
    case redefined and re-recorded since) and keeps what the record says of the others. When the code
    changed since the record but gives, on this machine, exactly the numbers it was made against on every
    case, the record carries over to the code now (what a commit gave equals those numbers); otherwise it
    starts empty and names the commits to check again. With no commit, it only does that."""
    from flower_app.reproduction.code_versions import code_hashes, load, reference_hash
    from flower_app.run.config import load_variants

    def text(rel: str) -> str | None:
        return (ROOT / rel).read_text() if (ROOT / rel).is_file() else None

    names = list(CASES)
    if args and args[0] == "--cases":
        names = args[1].split(",")
        args = args[2:]
        if unknown := unknown_cases(names):
            print(f"same-numbers --cases: {unknown}")
            return 2
    code = code_hashes(app_modules(ROOT), text)
    record = load(text)
    changed, here = record.get("code") != code, machine()
    # every case runs when the code changed, or when the record lacks some case's numbers of this machine
    # (the next change of the code can carry the record over only if it holds all of them)
    whole = changed or record.get("machine") != here or not set(CASES) <= set(record.get("outputs", {}))
    reference = outputs_in(ROOT, CASES if whole else {name: CASES[name] for name in names})
    digests = output_digests(reference)
    if changed:
        checked = sorted(record.get("commits", {}))
        if checked and record.get("machine") == here and record.get("outputs") == digests \
                and len(digests) == len(CASES):
            print(f"the code now gives the numbers of the code the record was checked against on every case: "
                  f"its {len(checked)} commits carry over")
            record["code"] = code
        else:
            if checked:
                old = record.get("outputs", {})
                why = ("the record was made on another machine" if record.get("machine") != here else
                       f"the record lacks the numbers of {', '.join(sorted(set(CASES) - set(old)))} on this machine"
                       if not set(CASES) <= set(old) else
                       f"the code now changed the numbers of {', '.join(n for n in CASES if old[n] != digests.get(n))}")
                print(f"{why}: the record starts empty; check its commits again: same-numbers {' '.join(checked)}")
            record = {"code": code, "commits": {}}
    # the other cases' hashes stand only for this code on this machine
    kept = {} if changed or record.get("machine") != here else record.get("outputs", {})
    record["machine"] = here
    record["outputs"] = {**{k: v for k, v in kept.items() if k in CASES}, **digests}
    cases_now = {name: CASES[name] for name in names}
    covers = {name: {"algorithm": str(load_variants(exp, ov.split())[0].algorithm), "experiment": exp,
                     "reference": reference_hash(name, text)} for name, (exp, ov) in cases_now.items()}
    _write_record(record)
    for rev in args:
        short = short_commit(rev)
        outputs = outputs_at(short, cases_now)
        some = len(names) < len(CASES) and short in record["commits"]  # the others keep their results and date
        today = date.today().isoformat()
        cases = dict(record["commits"][short]["cases"]) if some else {}
        for name in names:
            got = outputs.get(name, {"error": "the commit's run of the cases stopped before it"})
            expected = reference.get(name, {"error": "the code now did not run it"})
            if "error" in got or "error" in expected:
                why = got.get("error") or f"the code now: {expected['error']}"
                cases[name] = {**covers[name], "result": "not run", "detail": why}
                continue
            where = difference(_clean(expected["result"]), _clean(got["result"]), exact=True)
            cases[name] = {**covers[name], "result": "differs" if where else "same", "detail": where}
        if some:
            cases.update({name: {**cases[name], "checked": today} for name in names})
        checked = record["commits"][short]["checked"] if some else today
        record["commits"][short] = {"checked": checked, "cases": dict(sorted(cases.items()))}
        counts = {r: sum(cases[n]["result"] == r for n in names) for r in ("same", "differs", "not run")}
        print(f"{short}: " + ", ".join(f"{n} {r}" for r, n in counts.items()), flush=True)
        _write_record(record)  # after each commit: a long list stopped half-way keeps what it saw
    return 0


def _write_record(record: dict) -> None:
    from flower_app.reproduction.code_versions import RECORD

    target = ROOT / RECORD
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    tmp.replace(target)


if __name__ == "__main__":
    os.environ.update(KERNELS)  # before torch is imported; a commit's child process of same-numbers inherits them
    sys.exit(main(sys.argv[1:]))
