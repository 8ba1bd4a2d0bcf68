"""What ``flrep run`` and ``flrep deploy`` share: the first-second checks, a run's folder prepared
before anything is written, the run's outcome as an exit code, and the command that continues it."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from task.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig


#: ``--jobs`` of ``flrep reproduce`` and ``flrep tune``.
JOBS_HELP = ("runs side by side, each its own flrep run (default 1). One run already spreads its clients over the "
             "CPU cores; side by side suits a GPU (with --set simulation.client_gpus=SHARE)")


def config_error(err: Exception) -> int:
    """Print ``err`` as flrep's configuration error; exit code 2."""
    print(f"flrep: configuration error: {err}", file=sys.stderr)
    return 2


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def resume_command(args: argparse.Namespace, out: Path) -> str:
    """The exact command that continues this command's run in ``out`` from its last checkpoint."""
    kept = [o for o in args.overrides if not o.startswith(("resume=", "out_dir="))]
    options = [f"--nodes={args.nodes}"] if getattr(args, "nodes", None) else []
    for name in ("tls", "node_data"):
        if getattr(args, name, None):
            options.append(f"--{name.replace('_', '-')}={Path(getattr(args, name)).resolve()}")
    return shlex.join(["flrep", args.command, args.experiment, *kept, *options, f"resume={out}"])


def _start_fresh_without_checkpoint(overrides: list[str], out: Path) -> list[str]:
    """``resume=out`` where ``out`` holds nothing to continue: say so, move any started files
    aside (nothing is deleted) and start a new run in ``out``."""
    from flower_app.run import run_dir

    moved = run_dir.move_aside(out)
    aside = f" (its files moved to {moved})" if moved is not None else ""
    print(f"flrep: no checkpoint in {out}{aside}, starting fresh", file=sys.stderr)
    return [o for o in overrides if not o.startswith("resume=")] + [f"out_dir={out}"]


def first_second_check(args: argparse.Namespace) -> bool:
    """The mistakes that need no heavy import, found in the command's first second (printed)."""
    from flower_app.run import run_dir
    from flower_app.run.precheck import quick_check
    from flower_app.run.resume_check import check_target

    try:
        check_target(args.overrides, args.out)
        if args.out:  # before the data check, which may download
            run_dir.check_writable(Path(args.out).expanduser().resolve(), "--out")
        quick_check(args.experiment, list(args.overrides))
    except ConfigError as err:
        print(f"flrep: configuration error: {err}", file=sys.stderr)
        return False
    return True


def prepare_run(args: argparse.Namespace, extra: list[str] = (), default_out: Path | None = None,
             check: Callable[[DictConfig], None] | None = None):
    """Overrides (the output directory fixed in them), the first variant and the output
    directory, after every check that needs no federation, ``check`` (the command's own)
    included: nothing is written before they pass. Else the exit code: 2 after printing a
    configuration error, 0 for a ``resume=`` of a run that completed (nothing is written)."""
    from flower_app.app import checkpoint
    from flower_app.run import run_dir, run_lock
    from flower_app.run.config import load_variants, shadowed_overrides
    from flower_app.run.smoke import describe_smoke
    from flower_app.app.outcome import output_dir
    from flower_app.run.resume_check import completed
    from flower_app.app.server_app import check_resume, preflight

    from flower_app.run.console import configure, say
    from task.data.federated_data import build_federated_data

    configure(args.verbose)
    since = command_start()
    overrides = list(args.overrides) + list(extra) + (["smoke=true"] if getattr(args, "smoke", False) else [])
    if args.out:
        overrides.append(f"out_dir={Path(args.out).expanduser().resolve()}")
    try:
        variants = load_variants(args.experiment, overrides)
        if variants[0].resume and completed(output_dir(variants[0])):
            check_resume(variants)  # a resume with another configuration is refused, as always
            print(f"flrep: the run in {output_dir(variants[0])} already completed; nothing to resume")
            return 0
        if not variants[0].resume and not variants[0].out_dir:  # fix the folder, so the outcome can be checked
            where = default_out.resolve() if default_out is not None else output_dir(variants[0])
            overrides.append(f"out_dir={where}")
            variants = load_variants(args.experiment, overrides)
        if check is not None:
            check(variants[0])
        run_dir.check_writable(output_dir(variants[0]))  # before the data: out_dir= and the default folder too
        run_lock.acquire(output_dir(variants[0]))  # before the first write: one command per folder
        if variants[0].resume and not checkpoint.resumable(output_dir(variants[0])):
            overrides = _start_fresh_without_checkpoint(overrides, output_dir(variants[0]))
            variants = load_variants(args.experiment, overrides)
        say(f"configuration checked: {args.experiment}, {len(variants)} variant(s)", since)
        for line in shadowed_overrides(args.experiment, overrides):
            say(line)
        if variants[0].smoke:
            for line in describe_smoke(args.experiment, overrides):
                say(f"smoke: {line}")
        loaded = time.time()
        fed = build_federated_data(variants[0].data, int(variants[0].seed))
        say(f"data ready: {variants[0].data.name}, {len(fed.bundle.train.y):,} train / {len(fed.bundle.test.y):,} "
            f"test samples, {fed.num_clients} clients partitioned in {time.time() - loaded:.1f}s", since)
        moved = preflight(variants, force=bool(getattr(args, "force", False)))
    except ConfigError as err:
        return config_error(err)
    out = output_dir(variants[0])
    if moved is not None:
        print(f"flrep: --force: the earlier run in {out} was moved to {moved}", file=sys.stderr)
    return overrides, variants[0], out


def command_start() -> float:
    """When this command's process started (epoch seconds)."""
    import psutil

    return psutil.Process().create_time()


def summary_stamp(out: Path) -> tuple[int, int] | None:
    """(mtime, size) of ``out``'s summary.json, or None."""
    path = out / "summary.json"
    return (path.stat().st_mtime_ns, path.stat().st_size) if path.is_file() else None


def run_outcome(out: Path, before: tuple[int, int] | None) -> int:
    """0 when the run wrote a new summary with status completed; ``before``: the old summary's stamp."""
    summary_path = out / "summary.json"
    if not summary_path.is_file() or summary_stamp(out) == before:
        print(f"flrep: run failed: no new {summary_path} was written", file=sys.stderr)
        return 1
    summary = json.loads(summary_path.read_text())
    status = summary.get("status")
    if status != "completed":
        reason = summary.get("failure_reason")
        print(f"flrep: run failed: status {status!r} in {summary_path}" + (f": {reason}" if reason else ""),
              file=sys.stderr)
        return 1
    print(f"flrep: outputs in {out}")
    return 0

