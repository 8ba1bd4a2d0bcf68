#!/usr/bin/env bash
# Every GPU figure the docs report, in one command on a GPU machine (docs/gpu.md, "Benchmark"):
#   bash bench/gpu_session.sh --wheels DIR --data DIR     (--help for the options; --device cpu --dry-run to check it)
exec "${PYTHON:-python3}" "$(dirname "$0")/gpu_session.py" "$@"
