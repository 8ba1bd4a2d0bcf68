"""Evidence: our split and client draws for a patched copy of official code (the official LG-FedAvg
main_fed.py, lg_official_paired.sh; the official FedRep main_fedrep.py, fedrep_official_paired.sh).

Writes a JSON file that the patched copy reads instead of drawing its own: ``dict_users_train``
and ``dict_users_test`` (each client's training and local test indices, in the official CIFAR
pickles' order) and ``clients`` (the clients of every round), all those of one committed run of
ours (rebuilt from its config.yaml with the app's own split and sampling; checked against its
metrics.jsonl where the run folder still has it); with ``--init PT`` also that run's initial
weights under the official CNNCifar's layer names. The pickles
(../shared/bench/cifar_jpeg_to_pickles.py) hold the copy's images in a fixed random order and
name each image ``<class>_<file>``; our train and test sets are the same images sorted by class
and file. The mapping is checked image by image on the names and the labels.

    python official_paired.py RUN_DIR PICKLE_DIR OUT_JSON [--init PT]
"""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from flower_app.run.config import clients_per_round, initial_model
from task.data.datasets.image_folder import _collect_image_entries, find_image_folder
from task.data.federated_data import build_federated_data
from task.data.sampling import sample_clients


#: The pickle files of each split, in the official loader's order.
BATCHES = {"train": [f"data_batch_{b}" for b in range(1, 6)], "test": ["test_batch"]}


def pickle_order(pickle_dir: Path, split: str) -> tuple[list[str], np.ndarray]:
    """The official ``split`` set's image names and labels, in the pickles' order."""
    names: list[str] = []
    labels: list[int] = []
    for batch_file in BATCHES[split]:
        with (pickle_dir / batch_file).open("rb") as fh:
            batch = pickle.load(fh, encoding="latin1")
        names += [n.decode() if isinstance(n, bytes) else n for n in batch["filenames"]]
        labels += batch["labels"]
    return names, np.asarray(labels)


def our_to_official(entries: list, split: str, our_labels: np.ndarray, pickle_dir: Path) -> np.ndarray:
    """Position in the official pickles of each of our ``split`` images (``entries``: the image
    folder's (split, class, name) entries; checked by name and label)."""
    ours = [f"{cls}_{Path(name).name}" for part, cls, name in entries if part == split]
    names, labels = pickle_order(pickle_dir, split)
    position = {n: j for j, n in enumerate(names)}
    if len(position) != len(names) or sorted(position) != sorted(ours):
        raise SystemExit(f"{pickle_dir}: its {split} image names are not our {split} set's")
    mapping = np.array([position[n] for n in ours])
    if not np.array_equal(labels[mapping], our_labels):
        raise SystemExit(f"{pickle_dir}: {split} labels differ from ours on the same images")
    return mapping


def official_init(cfg, bundle) -> dict[str, torch.Tensor]:
    """Our run's initial weights under the official CNNCifar's names (same order; the official load_state_dict checks the shapes)."""
    ours = initial_model(cfg, bundle).state_dict()
    names = [f"{layer}.{kind}" for layer in ("conv1", "conv2", "fc1", "fc2", "fc3") for kind in ("weight", "bias")]
    if len(ours) != len(names):
        raise SystemExit(f"our model has {len(ours)} tensors, the official CNNCifar {len(names)}")
    return {name: tensor.clone() for name, tensor in zip(names, ours.values())}


def run_clients(cfg, fed, run_dir: Path) -> list[list[int]]:
    """The clients of each of the run's rounds, as its server drew them; checked against the run's
    metrics.jsonl when the folder has it (it is not committed)."""
    if fed.new_clients or fed.online_device is not None:
        raise SystemExit(f"{run_dir}: the run holds clients out; the official scripts do not")
    seed, per_round = int(cfg.seed), clients_per_round(cfg)
    rounds = [sample_clients(range(fed.num_clients), per_round, seed, t) for t in range(1, int(cfg.rounds) + 1)]
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        logged = [d["clients"] for d in map(json.loads, metrics.open()) if d.get("phase") == "train"]
        if logged != rounds[:len(logged)]:
            raise SystemExit(f"{metrics}: the logged clients differ from the seed's draws")
        print(f"{metrics}: the clients of its {len(logged)} rounds match the seed's draws")
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="one of our runs (config.yaml; metrics.jsonl if present)")
    parser.add_argument("pickle_dir", type=Path, help="the official code's cifar-10-batches-py")
    parser.add_argument("out", type=Path)
    parser.add_argument("--init", type=Path, help="also write the run's initial weights here (official names)")
    args = parser.parse_args()
    cfg = OmegaConf.load(args.run_dir / "config.yaml")
    fed = build_federated_data(cfg.data, int(cfg.seed))
    entries, _ = _collect_image_entries(find_image_folder(Path(str(cfg.data.root))))
    train = our_to_official(entries, "train", np.asarray(fed.bundle.train.y), args.pickle_dir)
    test = our_to_official(entries, "test", np.asarray(fed.bundle.test.y), args.pickle_dir)
    rounds = run_clients(cfg, fed, args.run_dir)
    out = {"run": str(args.run_dir), "seed": int(cfg.seed),
           "dict_users_train": [train[idx].tolist() for idx in fed.client_train],
           "dict_users_test": [test[idx].tolist() for idx in fed.client_test], "clients": rounds}
    args.out.write_text(json.dumps(out))
    if args.init:
        torch.save(official_init(cfg, fed.bundle), args.init)
    print(f"{args.out}: {len(out['dict_users_train'])} clients, {len(rounds)} rounds of clients")


if __name__ == "__main__":
    main()
