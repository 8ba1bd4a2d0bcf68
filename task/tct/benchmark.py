"""TCT benchmark: eNTK feature extraction throughput (hooks, vmap, per-sample loop) and the
stage-2 round time (closed-form local GD vs explicit GD steps).

Builds ``--model`` (random init, one-output head from :func:`task.tct.entk.entk_network`),
selects ``--p`` coordinates and times :func:`task.tct.entk.extract_features` with each method on
the same samples (Fashion-MNIST images from ``--data``, else standard-normal inputs). Then,
on one client's problem of ``--stage2-n`` random float16 feature rows of the same p with
``--stage2-steps`` local steps: the one-time Gram spectrum, a closed-form SCAFFOLD round
(:class:`task.tct.linear.LocalLeastSquares`), and explicit full-batch GD steps (the official code's
loop: two matrix products per step), timed for ``--loop-steps`` steps and scaled to M.
Usage: ``flrep bench-entk [--model simple_cnn] [--device cpu] [--out FILE.json]``.
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

from task.data.datasets.idx import read_idx
from task.tct.entk import METHODS, entk_network, extract_features, parameter_count, select_coordinates
from task.errors import ConfigError
from task.learning.models import build_model
from task.tct.linear import FeatureMatrix, LocalLeastSquares, feature_moments, one_hot_targets, standardization

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


def measure_stage2(n: int, p: int, classes: int, steps: int, loop_steps: int, device: torch.device) -> dict:
    """Seconds of one client's stage-2 work: the Gram spectrum (once per run), one closed-form
    round of ``steps`` corrected GD steps, and explicit GD steps (scaled to ``steps``)."""
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(n, p, generator=gen).half()
    mean, std = standardization(*feature_moments(raw))
    features = FeatureMatrix(raw, mean, std, device)
    targets = one_hot_targets(torch.randint(0, classes, (n,), generator=gen), classes, False)
    _sync(device)
    start = time.perf_counter()
    spectrum = LocalLeastSquares.spectrum(features)
    _sync(device)
    spectrum_s = time.perf_counter() - start
    problem = LocalLeastSquares(features, targets, spectrum)
    lr = 0.5 * problem.max_stable_lr()
    w0 = torch.zeros(p, classes)
    correction = 1e-3 * torch.randn(p, classes, generator=gen)
    rounds = []
    for _ in range(3):
        _sync(device)
        start = time.perf_counter()
        closed = problem.gradient_descent(w0, steps, lr, correction)
        _sync(device)
        rounds.append(time.perf_counter() - start)
    z = torch.cat([block for _, block in features.blocks()])  # the explicit loop holds Z as float32
    y, d, w = targets.to(device), correction.to(device), w0.to(device)
    _sync(device)
    start = time.perf_counter()
    for _ in range(loop_steps):
        w = w - lr * (z.T @ (z @ w - y) / n + d)
    _sync(device)
    loop_s = time.perf_counter() - start
    check = problem.gradient_descent(w0, loop_steps, lr, correction).to(device)
    return {"n": n, "p": p, "classes": classes, "local_steps": steps, "spectrum_s": spectrum_s,
            "closed_form_round_s": statistics.median(rounds),
            "explicit_steps_timed": loop_steps, "explicit_step_s": loop_s / loop_steps,
            "explicit_round_s": loop_s / loop_steps * steps,
            "explicit_round_is_scaled": loop_steps != steps,
            "max_rel_diff_closed_vs_explicit": float((check - w).abs().max() / w.abs().max().clamp_min(1e-30)),
            "closed_form_norm": float(closed.norm())}


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
    parser = argparse.ArgumentParser(prog="python -m task.tct.benchmark", description=__doc__)
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
    parser.add_argument("--stage2-n", type=int, default=6000, help="stage 2: samples of one client")
    parser.add_argument("--stage2-steps", type=int, default=500, help="stage 2: local steps M")
    parser.add_argument("--loop-steps", type=int, default=50, help="stage 2: explicit GD steps timed")
    parser.add_argument("--classes", type=int, default=10, help="stage 2: classes C")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown or not args.methods:
        parser.error(f"--methods: unknown {unknown}; allowed: {','.join(METHODS)}")
    if min(args.samples, args.batch_size, args.repeats, args.stage2_n, args.stage2_steps, args.loop_steps,
           args.classes) < 1:
        parser.error("--samples, --batch-size, --repeats and the --stage2/--loop/--classes sizes must be positive")
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
    stage2 = measure_stage2(args.stage2_n, args.p, args.classes, args.stage2_steps, args.loop_steps, device)
    report = {
        "model": args.model, "num_params": num_params, "p": args.p, "samples": args.samples,
        "batch_size": args.batch_size, "repeats": args.repeats, "device": str(device),
        "inputs": inputs, "machine": machine_info(), "results": results, "stage2": stage2,
    }
    print(f"{args.model}: {num_params} parameters, p={args.p}, {args.samples} samples ({inputs}), "
          f"batch {args.batch_size}, {device}, median of {args.repeats}")
    _print_table(results)
    scaled = f" (timed {stage2['explicit_steps_timed']} steps)" if stage2["explicit_round_is_scaled"] else ""
    print(f"stage 2, one client n={stage2['n']}, p={stage2['p']}, M={stage2['local_steps']}: spectrum (once) "
          f"{stage2['spectrum_s']:.2f}s, closed-form round {stage2['closed_form_round_s']:.3f}s, explicit GD round "
          f"{stage2['explicit_round_s']:.2f}s{scaled}; max rel diff {stage2['max_rel_diff_closed_vs_explicit']:.1e}")
    print("machine:", json.dumps(report["machine"]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
