"""eNTK feature extraction throughput: the hooks, vmap and per-sample loop methods.

Builds ``--model`` (random init, one-output head from :func:`task.entk.entk_network`),
selects ``--p`` coordinates and times :func:`task.entk.extract_features` with each method on
the same samples (Fashion-MNIST images from ``--data``, else standard-normal inputs).
Usage: ``python -m task.entk_benchmark [--model simple_cnn] [--device cpu] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from task.datasets.idx import read_idx
from task.entk import METHODS, entk_network, extract_features, parameter_count, select_coordinates
from task.errors import ConfigError
from task.models import build_model

#: Benchmarked models: input shape and number of classes of the trained network.
MODELS: dict[str, tuple[tuple[int, int, int], int]] = {
    "simple_cnn": ((1, 28, 28), 10),
    "resnet18_gn": ((3, 32, 32), 10),
}
_FASHION_IMAGES = "train-images-idx3-ubyte"


def machine_info() -> dict:
    """Platform, CPU model, torch threads and version, and the GPU name if CUDA is available."""
    return {
        "platform": platform.platform(),
        "cpu": _cpu_model() or platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _cpu_model() -> str | None:
    """The first ``model name`` of /proc/cpuinfo, if there is one."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return None
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def load_inputs(shape: tuple[int, ...], samples: int, data: str | None) -> tuple[Tensor, str]:
    """``samples`` inputs and their description: Fashion-MNIST images in [0, 1], or N(0, 1)."""
    if data is None:
        return torch.randn((samples, *shape), generator=torch.Generator().manual_seed(0)), "standard normal"
    if shape != (1, 28, 28):
        raise ConfigError(f"--data: Fashion-MNIST images are (1, 28, 28), the model needs {shape}")
    root = Path(data)
    path = next((p for p in (root / f"{_FASHION_IMAGES}.gz", root / _FASHION_IMAGES) if p.is_file()), None)
    if path is None:
        raise ConfigError(f"--data: no {_FASHION_IMAGES}[.gz] in {root}")
    images = read_idx(path, 3)
    if len(images) < samples:
        raise ConfigError(f"--data: {path} has {len(images)} images, fewer than --samples {samples}")
    x = torch.from_numpy(images[:samples].copy()).float().div_(255).unsqueeze(1)
    return x, f"Fashion-MNIST ({path})"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_method(
    model: nn.Module, x: Tensor, coords: Tensor, method: str, batch_size: int, repeats: int
) -> tuple[list[float], Tensor]:
    """Seconds of each of ``repeats`` timed runs (after a one-batch warm-up), and the features."""
    device = x.device
    out = torch.empty(len(x), len(coords), device=device)
    extract_features(model, x[:batch_size], coords, out[:batch_size], method, batch_size)
    seconds = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        extract_features(model, x, coords, out, method, batch_size)
        _sync(device)
        seconds.append(time.perf_counter() - start)
    return seconds, out


def _is_out_of_memory(err: RuntimeError) -> bool:
    text = str(err).lower()
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


def measure(model: nn.Module, x: Tensor, coords: Tensor, methods: list[str], batch_size: int,
            repeats: int) -> dict[str, dict]:
    """Per method: median samples/s, run times, speedup and max |difference| vs ``loop``."""
    results: dict[str, dict] = {}
    features: dict[str, Tensor] = {}
    for method in methods:
        try:
            seconds, features[method] = time_method(model, x, coords, method, batch_size, repeats)
        except RuntimeError as err:
            if not _is_out_of_memory(err):
                raise
            results[method] = {"error": f"out of memory: {str(err).splitlines()[0]}"}
            if x.device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        results[method] = {"samples_per_s": len(x) / statistics.median(seconds), "seconds": seconds}
    reference = features.get("loop")
    for method, row in results.items():
        if "error" in row or reference is None:
            continue
        row["speedup_vs_loop"] = row["samples_per_s"] / results["loop"]["samples_per_s"]
        row["max_abs_diff_vs_loop"] = (features[method] - reference).abs().max().item()
    if reference is not None:
        results["loop"]["feature_max_abs"] = reference.abs().max().item()
    return results


def _print_table(results: dict[str, dict]) -> None:
    print(f"{'method':<8} {'samples/s':>11} {'speedup':>9} {'max|diff| vs loop':>18}")
    for method, row in results.items():
        if "error" in row:
            print(f"{method:<8} {row['error']}")
            continue
        speedup = f"{row['speedup_vs_loop']:.2f}x" if "speedup_vs_loop" in row else "-"
        diff = f"{row['max_abs_diff_vs_loop']:.2e}" if "max_abs_diff_vs_loop" in row else "-"
        print(f"{method:<8} {row['samples_per_s']:>11.1f} {speedup:>9} {diff:>18}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m task.entk_benchmark", description=__doc__)
    parser.add_argument("--model", default="simple_cnn", choices=sorted(MODELS))
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--p", type=int, default=100_000, help="eNTK coordinates kept")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cpu", "cuda"])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of "
                        + ",".join(METHODS))
    parser.add_argument("--data", help="Fashion-MNIST directory with train-images-idx3-ubyte[.gz]")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown or not args.methods:
        parser.error(f"--methods: unknown {unknown}; allowed: {','.join(METHODS)}")
    if min(args.samples, args.batch_size, args.repeats) < 1:
        parser.error("--samples, --batch-size and --repeats must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and optionally write JSON."""
    args = _parse(argv)
    device = torch.device(args.device)
    shape, classes = MODELS[args.model]
    torch.manual_seed(0)
    model = entk_network(build_model(args.model, shape, classes), seed=0).to(device)
    num_params = parameter_count(model)
    try:
        coords = select_coordinates(num_params, args.p, seed=0)
        x, inputs = load_inputs(shape, args.samples, args.data)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    results = measure(model, x.to(device), coords, args.methods, args.batch_size, args.repeats)
    report = {
        "model": args.model, "num_params": num_params, "p": args.p, "samples": args.samples,
        "batch_size": args.batch_size, "repeats": args.repeats, "device": str(device),
        "inputs": inputs, "machine": machine_info(), "results": results,
    }
    print(f"{args.model}: {num_params} parameters, p={args.p}, {args.samples} samples ({inputs}), "
          f"batch {args.batch_size}, {device}, median of {args.repeats}")
    _print_table(results)
    print("machine:", json.dumps(report["machine"]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
