"""Start-up of a command, as a user sees it: seconds to the first line, to each ``[flrep]``
line, to round 1's line, and to the end. Used for docs/benchmark.md's start-up section:

    python docs/bench-cpu/startup.py --out docs/bench-cpu/startup.json -- flrep run quickstart rounds=2 --out /tmp/qs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time


def measure(cmd: list[str]) -> dict:
    """Run ``cmd`` (stderr merged into stdout) and time every line it prints."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [(round(time.monotonic() - start, 2), line.rstrip()) for line in proc.stdout]
    code = proc.wait()
    first_round = next((t for t, line in lines if "round 1/" in line), None)
    return {"command": cmd, "exit": code, "total_s": round(time.monotonic() - start, 2),
            "first_line_s": lines[0][0] if lines else None, "round_1_line_s": first_round,
            "lines": [[t, line[:160]] for t, line in lines if "[flrep]" in line or "flrep:" in line]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="append the measurement to this JSON list")
    parser.add_argument("--label", default="", help="a name for this measurement (e.g. the commit)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    result = {"label": args.label, **measure([c for c in args.cmd if c != "--"])}
    print(json.dumps({k: v for k, v in result.items() if k != "lines"}))
    if args.out:
        try:
            with open(args.out) as fh:
                results = json.load(fh)
        except FileNotFoundError:
            results = []
        results.append(result)
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
