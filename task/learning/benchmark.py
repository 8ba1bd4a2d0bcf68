"""Local-training throughput: this project's engine vs a plain DataLoader loop.

Both train the same model with the same SGD settings on the same client-sized data; the
engine keeps the data as tensors on the device and slices a seeded permutation, the
baseline builds a ``torch.utils.data.DataLoader`` each round as many FL codebases do.
Usage: ``flrep bench [--device cpu|cuda] [--repeats 3] [--out docs/benchmark.json]`` (or
``python -m task.learning.benchmark``, which needs no Flower).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from task.learning.engine import OptimizerConfig, TensorData, fast_layout, precision, train
from task.learning.models import build_model

# (model, input shape, classes, client samples, batch size): the papers' client settings
CASES = (
    ("digits_mlp", (1, 8, 8), 10, 90, 10),
    ("mlp_mnist", (1, 28, 28), 10, 600, 10),
    ("fedrep_cnn", (3, 32, 32), 10, 500, 10),
    ("lenet5", (3, 32, 32), 10, 500, 50),
)
OPT = OptimizerConfig(lr=0.01, momentum=0.5, weight_decay=1e-4)


def _engine_epoch(model, x, y, batch, seed, precision_name: str = "fp32") -> None:
    with precision(precision_name, x.device):
        train(model, TensorData(x, y), OPT, batch, torch.Generator().manual_seed(seed), epochs=1)


def _dataloader_epoch(model, x, y, batch, seed) -> None:
    torch.manual_seed(seed)
    loader = DataLoader(TensorDataset(x.cpu(), y.cpu()), batch_size=batch, shuffle=True)
    opt = OPT.build(list(model.parameters()), model)
    model.train()
    device = x.device
    for xb, yb in loader:
        xb, yb = xb.to(device), yb.to(device)
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()


#: label -> (train.precision, channels-last layout); precision None is the DataLoader loop (the reference form)
VARIANTS = {
    "engine_fp32_contiguous": ("fp32", False),
    "engine_fp32": ("fp32", True),
    "engine_bf16": ("bf16", True),
    "dataloader": (None, False),
}


def measure(case: tuple, device: torch.device, repeats: int, epochs: int) -> dict:
    """Samples/s of each variant for one case (median over ``repeats`` timed runs). The engine
    runs as clients run it (channels-last layout for convolutional models, ``fast_layout``), at
    each ``train.precision``, and once with the plain layout; the DataLoader loop in float32."""
    name, shape, classes, n, batch = case
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn((n, *shape), generator=gen).to(device)
    y = torch.randint(0, classes, (n,), generator=gen).to(device)
    result = {"model": name, "samples": n, "batch_size": batch}
    for label, (precision_name, layout) in VARIANTS.items():
        torch.manual_seed(0)
        model = build_model(name, shape, classes).to(device)
        data = TensorData(x0.clone(), y)
        if layout:
            fast_layout(model, [data])
        x = data.x
        if precision_name is None:
            def fn(seed, model=model, x=x):
                _dataloader_epoch(model, x, y, batch, seed)
        else:
            def fn(seed, model=model, x=x, precision_name=precision_name):
                _engine_epoch(model, x, y, batch, seed, precision_name)
        fn(0)  # warm-up
        rates = []
        for r in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for e in range(epochs):
                fn(1 + r * epochs + e)
            if device.type == "cuda":
                torch.cuda.synchronize()
            rates.append(n * epochs / (time.perf_counter() - start))
        result[f"{label}_samples_per_s"] = statistics.median(rates)
    result["speedup"] = result["engine_fp32_samples_per_s"] / result["dataloader_samples_per_s"]
    result["speedup_bf16"] = result["engine_bf16_samples_per_s"] / result["dataloader_samples_per_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flrep bench", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2, help="local epochs per timed run")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = [measure(case, device, args.repeats, args.epochs) for case in CASES]
    machine = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    print(f"{'model':<12} {'n':>5} {'batch':>5} {'fp32 plain':>10} {'fp32':>8} {'bf16':>8} {'DataLoader':>10} "
          f"{'fp32 x':>7} {'bf16 x':>7}   (samples/s; x = vs DataLoader)")
    for r in rows:
        print(f"{r['model']:<12} {r['samples']:>5} {r['batch_size']:>5} {r['engine_fp32_contiguous_samples_per_s']:>10.0f} "
              f"{r['engine_fp32_samples_per_s']:>8.0f} {r['engine_bf16_samples_per_s']:>8.0f} "
              f"{r['dataloader_samples_per_s']:>10.0f} {r['speedup']:>6.2f}x {r['speedup_bf16']:>6.2f}x")
    print("machine:", json.dumps(machine))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"machine": machine, "results": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
