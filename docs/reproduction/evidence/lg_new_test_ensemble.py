"""Evidence: how LG-FedAvg Table 1's New Test depends on the ensemble's averaging rule.

Question. On CIFAR-10 our Local only New Test is 7 to 9 points below the paper's 54.83. New
Test passes each test image through all 100 devices' models and ensembles them. The paper says
it averages the models' logits; the official code averages their log-softmax outputs (the same
ranking). What do other common rules give on the same trained models?

What it does: for each run folder given (a finished ``flrep reproduce`` run whose client
checkpoints are still on this machine; they are not committed), it loads every client's model
from ``checkpoint/clients/<client>/round<last>.pt`` entry ``ENTRY`` and scores the ensemble on
the run's test set (``data.root`` of its config.yaml, normalised with the train statistics, as
the run) four ways: mean logits (the run's rule: must equal the summary's
``new_test_accuracy``), mean log-softmax (the official code's), mean softmax probabilities, and
a majority vote of the models' predictions.

Run:

    cd /work/main && . .venv/bin/activate && export FLREP_DATA=/work/shared/datasets
    python docs/reproduction/evidence/lg_new_test_ensemble.py \\
        docs/reproduction/lg_table1_cifar10/runs/local_only_200/seed0:local_only/best-local-test-model

Adds its results to ``lg_new_test_ensemble.json`` next to itself and prints them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from task.data.datasets.image_folder import load_image_folder  # noqa: E402
from task.data.datasets.images import normalize_images  # noqa: E402
from task.learning.models import build_model  # noqa: E402

OUT = Path(__file__).with_suffix(".json")


def client_logits(run: Path, entry: str, x: torch.Tensor, model_name: str) -> torch.Tensor:
    """(clients, N, classes) logits of every client's ``entry`` model in the run's last checkpoint."""
    logits = []
    for folder in sorted((run / "checkpoint" / "clients").iterdir()):
        last = sorted(folder.glob("round*.pt"))[-1]
        arrays = torch.load(last, weights_only=False)["entries"][entry]["arrays"]
        model = build_model(model_name, tuple(x.shape[1:]), 10)
        model.load_state_dict({k: torch.as_tensor(v) for k, v in arrays.items()})
        model.eval()
        with torch.no_grad():
            logits.append(torch.cat([model(xb) for xb in x.split(2000)]))
    return torch.stack(logits)


def ensemble_accuracies(logits: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Accuracy (%) of the four averaging rules over the clients' ``logits``."""
    def acc(pred: torch.Tensor) -> float:
        return round(float((pred == y).double().mean()) * 100, 2)

    votes = torch.nn.functional.one_hot(logits.argmax(2), logits.shape[2]).sum(0)
    return {
        "mean_logits": acc(logits.mean(0).argmax(1)),
        "mean_log_softmax": acc(logits.log_softmax(2).mean(0).argmax(1)),
        "mean_softmax": acc(logits.softmax(2).mean(0).argmax(1)),
        "majority_vote": acc(votes.argmax(1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN:ENTRY",
                        help="a run folder and the checkpoint entry holding each client's whole model")
    args = parser.parse_args()
    torch.set_num_threads(1)
    saved = json.loads(OUT.read_text()) if OUT.exists() else {}
    test_sets: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # by data root: runs on one copy decode it once
    for spec in args.runs:
        folder, entry = spec.split(":", 1)
        run = Path(folder)
        cfg = OmegaConf.load(run / "config.yaml")
        if cfg.data.root not in test_sets:
            with tempfile.TemporaryDirectory() as cache:
                bundle = load_image_folder(Path(cfg.data.root), {}, Path(cache), 10)
            normalize_images(bundle)
            test_sets[cfg.data.root] = torch.from_numpy(np.asarray(bundle.test.x)), torch.from_numpy(bundle.test.y)
        x, y = test_sets[cfg.data.root]
        result = ensemble_accuracies(client_logits(run, entry, x, cfg.model.name), y)
        summary = json.loads((run / "summary.json").read_text())
        result["summary_new_test_accuracy"] = round(100 * summary["new_test_accuracy"], 2)
        result["data_root"] = str(cfg.data.root)
        key = f"{run.resolve().relative_to(REPO) if run.resolve().is_relative_to(REPO) else run}:{entry}"
        saved[key] = result
        print(key, result, flush=True)
        OUT.write_text(json.dumps(saved, indent=1) + "\n")


if __name__ == "__main__":
    main()
