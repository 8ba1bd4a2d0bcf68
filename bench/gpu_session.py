"""Every GPU figure the docs report, from one command on a GPU machine (online or not).

Run through ``bench/gpu_session.sh`` (docs/gpu.md, "Benchmark"). It installs the given
wheels when Flower, Ray and the rest are missing (files split in parts, ``NAME.part00``,
``NAME.part01``, ..., are joined first), then runs the existing commands one after another:
``flrep bench``, ``flrep bench-entk``, ``flrep bench-round``, a 100-round ``flrep run`` and one
``flrep reproduce`` table cell. Each step's output goes to ``session.log``, its wall time and
figure to ``summary.md``, both in ``--out`` (default ``docs/bench-gpu/<date>/``). A step that
would not fit in what is left of ``--budget`` is skipped with the reason; a running step is
stopped at the budget. A failed step is recorded and the next one runs; the exit code is 1 if
any step failed. ``--dry-run`` runs the same steps at tiny sizes (``--device cpu`` on a CPU).
Standard library only: Flower may not be installed when it starts.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NEEDED = ("flwr", "ray", "omegaconf", "datasets", "flwr_datasets")  # what a bare GPU image may lack
SITE = Path(tempfile.gettempdir()) / "flrep-site"  # where the given wheels go (on every child's PYTHONPATH)
PART = re.compile(r"^(?P<name>.+)\.part\d+$")
EXPERIMENT = ["fedrep_cifar10_100x2", "eval.every=1", "train.augment=crop_flip"]  # docs/benchmark.md's runs
# --dry-run: all ten clients of 5,000 images each round, 50 steps a phase: each client trains, so the runs beat
# the learned-nothing check (each client's own majority label)
TINY = ["rounds=2", "data.num_clients=10", "train.fraction=1.0", "train.batch_size=50", "fedrep.head_epochs=1",
        "fedrep.head_steps=50", "train.local_steps=50"]
CELL = {False: ("fedrep_table1_cifar10", "fedavg_100x2"), True: ("lg_table4_adult", "lg_noniid")}  # by dry run
CELL_GPUS = 0.2


@dataclass
class Step:
    name: str
    command: list[str]
    estimate_s: float  # skipped when less than this is left of the budget
    file: str | None = None  # the figure's JSON, in the output folder
    figure: Callable[[dict], str] | None = None  # the JSON -> one line
    copy_from: Path | None = None  # a run's summary.json, copied to ``file`` after the command
    status: str = "not run"
    wall_s: float | None = None
    text: str = ""  # the figure, or why the step failed or was skipped


def engine_figure(d: dict) -> str:
    return ", ".join(f"{r['model']} {r['engine_fp32_contiguous_samples_per_s']:,.0f}" for r in d["results"]) + \
        " samples/s (fp32)"


def entk_figure(d: dict) -> str:
    h = d["results"]["hooks"]
    return (f"hooks {h['samples_per_s']:,.0f} samples/s = {h['speedup_vs_loop']:.1f}x the loop, "
            f"largest difference {h['max_abs_diff_vs_loop']:.1e}")


def round_figure(d: dict) -> str:
    return f"{d['per_round_s']:.2f} s/round over {d['rounds']} rounds, app start-up {d['app_startup_s']:.1f} s"


def run_figure(d: dict) -> str:
    return (f"personalized acc {d['personalized_accuracy']:.2%} (last {min(d['final_window'], d['rounds'])} rounds), "
            f"{d['rounds']} rounds, {d['wall_time_s']:.1f} s in the ServerApp")


def steps(device: str, dry: bool, out: Path, work: Path) -> list[Step]:
    """The session's steps; ``dry``: the same commands at tiny sizes."""
    flrep = [sys.executable, "-m", "flower_app.cli"]
    gpu = device == "cuda"
    place = ["simulation.client_gpus=0.1"] if gpu else ["simulation.device=cpu"]
    tiny = TINY if dry else []
    table, cell = CELL[dry]
    run_dir, cell_dir = work / "fedrep_100rounds", work / "table"
    return [
        Step("engine", [*flrep, "bench", "--device", device, "--repeats", "1" if dry else "3",
                        *(["--epochs", "1", "--threads", "1"] if dry else []), "--out", str(out / "engine.json")], 30, "engine.json", engine_figure),
        Step("entk", [*flrep, "bench-entk", "--model", "simple_cnn", "--device", device,
                      *(["--samples", "64", "--p", "1000", "--repeats", "1", "--stage2-n", "200", "--stage2-steps",
                         "10", "--loop-steps", "2"] if dry else ["--samples", "2048", "--p", "100000", "--repeats", "3"]),
                      "--out", str(out / "entk.json")], 45, "entk.json", entk_figure),
        Step("bench-round", [*flrep, "bench-round", *EXPERIMENT, *place, *tiny, "--device", device,
                             "--rounds", "1" if dry else "3", "--out", str(out / "bench_round.json")],
             90, "bench_round.json", round_figure),
        Step("run", [*flrep, "run", *EXPERIMENT, *place, "compare=[]", *tiny, "--out", str(run_dir)],
             240, "fedrep_100rounds_summary.json", run_figure, run_dir / "summary.json"),
        Step("table-cell", [*flrep, "reproduce", table, "--only", cell, "--seeds", "0", "--out", str(cell_dir),
                            "--set", f"simulation.client_gpus={CELL_GPUS}" if gpu else "simulation.device=cpu"],
             180, "table_cell_summary.json", run_figure, cell_dir / "runs" / cell / "seed0" / "summary.json"),
    ]


def join_parts(folder: Path) -> list[Path]:
    """Files split in parts (``NAME.part00``, ``NAME.part01``, ...) joined into ``NAME`` once."""
    groups: dict[Path, list[Path]] = {}
    for part in sorted(folder.rglob("*.part*")):
        m = PART.match(part.name)
        if m:
            groups.setdefault(part.with_name(m["name"]), []).append(part)
    for target, parts in groups.items():
        if not target.exists():
            partial = target.with_name(target.name + ".joining")
            with open(partial, "wb") as out:
                for part in parts:
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out)
            partial.rename(target)
    return list(groups)


def install(wheels: Path | None) -> str:
    """Install the given wheels into :data:`SITE` when a package is missing (there or here)."""
    sys.path.insert(0, str(SITE))
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if not missing:
        return "none needed: " + ", ".join(NEEDED) + " importable"
    if wheels is None:
        raise RuntimeError(f"{', '.join(missing)} missing and no --wheels DIR (or FLREP_WHEELS) given")
    join_parts(wheels)
    files = sorted(wheels.rglob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, files)], check=True)
    return f"{len(files)} wheels installed for {', '.join(missing)}"


def run_step(step: Step, out: Path, env: dict, log, timeout: float) -> None:
    """Run one step's command (output to ``log``), stop it at ``timeout`` seconds, and read its figure
    from its JSON in ``out``; on failure, print the end of its output."""
    log.write(f"\n$ {' '.join(step.command)}\n")
    log.flush()
    start = log.tell()
    t0 = time.monotonic()
    proc = subprocess.Popen(step.command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group: stopped with its Ray workers
    try:
        code = proc.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as err:
        stop(proc)
        if isinstance(err, KeyboardInterrupt):
            raise
        code = None
    step.wall_s = time.monotonic() - t0
    if code is None:
        step.status, step.text = "failed", f"stopped at the budget after {step.wall_s:.0f} s"
    elif code != 0:
        step.status, step.text = "failed", f"exit {code}"
    else:
        try:
            if step.copy_from is not None:
                shutil.copyfile(step.copy_from, out / step.file)
            step.status, step.text = "ok", step.figure(json.loads((out / step.file).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as err:
            step.status, step.text = "failed", f"no figure: {err!r}"
    if step.status != "ok":
        with open(log.name) as f:
            f.seek(start)
            print("".join(f.readlines()[-15:]), end="", flush=True)


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C to the step's process group (flrep run stops cleanly), SIGKILL if still there after 30 s."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def machine(env: dict) -> str:
    """GPU (or CPU), torch and the checked-out commit, for the summary's first line."""
    probe = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU', torch.__version__)"
    torch_line = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return f"{torch_line or 'torch not importable'}, {os.cpu_count()} cores, commit {commit.stdout.strip() or 'unknown'}"


def summary(steps_done: list[Step], head: str) -> str:
    lines = [f"# GPU session {datetime.date.today()}", "", head, "",
             "| step | status | wall s | figure | file |", "|---|---|---|---|---|"]
    for s in steps_done:
        wall = f"{s.wall_s:.1f}" if s.wall_s is not None else ""
        lines.append(f"| {s.name} | {s.status} | {wall} | {s.text} | {s.file if s.status == 'ok' and s.file else ''} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/gpu_session.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dry-run", action="store_true", help="the same steps at tiny sizes (a check of this script)")
    p.add_argument("--data", type=Path, default=os.environ.get("FLREP_DATA"),
                   help="the data home (FLREP_DATA), holding cifar10-jpeg/CIFAR-10-images-jpeg.tar or its parts")
    p.add_argument("--wheels", type=Path, default=os.environ.get("FLREP_WHEELS"),
                   help="folder of wheels for this Python (and parts NAME.part00, ...), installed if Flower is missing")
    p.add_argument("--out", type=Path, help="figures and summary.md (default docs/bench-gpu/<date>; "
                                            "with --dry-run a new temporary folder)")
    p.add_argument("--work", type=Path, help="the runs' folders (default a new temporary folder)")
    p.add_argument("--budget", type=float, default=480, help="seconds for the whole session (default 480)")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    if args.out is None:
        args.out = (Path(tempfile.mkdtemp(prefix="flrep-gpu-dry-")) if args.dry_run
                    else REPO / "docs" / "bench-gpu" / str(datetime.date.today()))
    out = args.out.resolve()
    work = (args.work or Path(tempfile.mkdtemp(prefix="flrep-gpu-work-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(SITE), os.environ.get("PYTHONPATH")])))
    if args.data is not None:
        join_parts(args.data)
        env["FLREP_DATA"] = str(args.data.resolve())
    print(f"[gpu-session] figures in {out}, runs in {work}, budget {args.budget:.0f} s", flush=True)

    wheels = Step("wheels", [], 0)
    try:
        wheels.text = install(args.wheels and args.wheels.resolve())
        wheels.status = "ok"
    except (RuntimeError, subprocess.CalledProcessError) as err:
        wheels.status, wheels.text = "failed", str(err)
    wheels.wall_s = time.monotonic() - t0
    print(f"[gpu-session] wheels: {wheels.status}, {wheels.text} ({wheels.wall_s:.1f} s)", flush=True)
    done = [wheels]
    with open(out / "session.log", "w") as log:
        for step in steps(args.device, args.dry_run, out, work):
            left = args.budget - (time.monotonic() - t0)
            if step.estimate_s > left:
                step.status, step.text = "skipped", f"needs about {step.estimate_s:.0f} s, {left:.0f} s left of the budget"
            else:
                print(f"[gpu-session] {step.name}: flrep {' '.join(step.command[3:])}", flush=True)
                run_step(step, out, env, log, left)
            done.append(step)
            print(f"[gpu-session] {step.name}: {step.status}, {step.text}"
                  + (f" ({step.wall_s:.1f} s)" if step.wall_s is not None else ""), flush=True)
    table = summary(done, f"{machine(env)}; {'dry run, ' if args.dry_run else ''}device {args.device}, "
                          f"total {time.monotonic() - t0:.0f} s of a {args.budget:.0f} s budget; runs in {work}")
    (out / "summary.md").write_text(table)
    print(table, end="")
    return 1 if any(s.status == "failed" for s in done) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the running step was stopped first
        sys.exit(130)
