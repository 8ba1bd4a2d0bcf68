"""Evidence: how FedRep Table 1's +FT number depends on how the head is fine-tuned
(docs/reproduction/fedrep_table1_cifar10/table.md, its notes).

Question. Our FedProx+FT at CIFAR-10 (100, 2) is 1.9 points above the paper's 85.81. Our +FT
(``finetune.head_features=eval``) trains each client's head for 10 epochs on body features
computed once from its un-augmented training images. The official FedRep code fine-tunes in
its final round with the training transform (random crop + flip) on every batch, the model in
train mode, and, for FedProx, its FedProx optimizer still pulling the weights towards the
global model (lgcollins/FedRep ``models/Update.py``, ``LocalUpdate.train(last=True)``; default
mu = 0.1). How much does each of those move the number on the same trained model?

What this script does (no Flower): for a finished ``flrep run`` of the table (a run folder
with its server checkpoint), it rebuilds the run's global model (``model_from_run``) and its
clients' data (``build_federated_data`` with the run's own config), and fine-tunes every
client from that same model in each variant, through the repo's +FT client function
(``protocols.finetune.finetune``) or, for the proximal variants, the engine's ``train`` with
``prox_mu``:

* ``eval``: ours (``finetune.head_features=eval``): features computed once, no augmentation;
* ``train_mode``: the official code's passes (``finetune.head_features=train_mode``): train
  mode, ``train.augment`` (crop + flip) on every batch;
* ``train_mode_prox``: as ``train_mode`` plus the FedProx term (mu/2)·||w − w_global||² on the
  head, with ``--prox-mu`` (default 0.1, the official code's default ``--mu``; the paper's tuned
  value is lost from our copy; the official code fine-tunes with the ``--mu`` it trained with)
  and its pull placed as ``--prox-pull`` says (default ``after_momentum``, the official FedProx
  optimizer; entries without ``prox_pull``, made before 2026-11-25, used ``gradient``);
* ``full``: every layer (``finetune.part=full``): train mode, crop + flip, as the official
  code's final round for FedAvg and FedProx actually runs (its body freeze checks names against
  a list of lists, so nothing is frozen; found 2026-11-25);
* ``full_prox``: as ``full`` plus the FedProx term on every layer (the official FedProx+FT).

Each variant reports the mean over clients of local test accuracy after fine-tuning (the
table's ``finetune_accuracy_after``), with the same seeded batches in every variant.

Run (one thread; a few CPU-minutes per run):

    cd /work/main && . .venv/bin/activate
    python docs/reproduction/evidence/fedrep_table1_ft.py \\
        docs/reproduction/fedrep_table1_cifar10/runs/fedprox_100x2/seed0 ...
    python docs/reproduction/evidence/fedrep_table1_ft.py --prox-mu 1 \
        docs/reproduction/fedrep_table1_cifar10/runs/fedprox_official_mu1_100x2/seed0

Writes ``fedrep_table1_ft.json`` next to itself (one entry per run folder, merged with what is
there) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, RecordDict
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from flower_app.app import checkpoint  # noqa: E402
from flower_app.run.config import head_groups  # noqa: E402
from flower_app.tools.export import model_from_run  # noqa: E402
from protocols.finetune import finetune  # noqa: E402
from strategies.common import ARRAYS, METRICS, ClientRuntime  # noqa: E402
from task.data.datasets.images import ImageArray  # noqa: E402
from task.data.federated_data import build_federated_data  # noqa: E402
from task.learning.engine import PROX_PULLS, TensorData, train  # noqa: E402

VARIANTS = ("eval", "train_mode", "train_mode_prox", "full", "full_prox")
OUT = Path(__file__).with_suffix(".json")


def tensors(bundle) -> tuple[TensorData, TensorData]:
    """The run's train/test arrays as CPU tensors, as the ClientApp holds them."""
    return tuple((TensorData.stored_images if isinstance(s.x, ImageArray) else TensorData.from_arrays)(
        s.x, s.y, torch.device("cpu")) for s in (bundle.train, bundle.test))


def finetuned_accuracy(cfg, model, fed, train_all, test_all, variant: str, prox_mu: float,
                       prox_pull: str) -> list[float]:
    """Every client's local test accuracy after +FT of ``model`` in ``variant`` (``prox_mu`` and
    ``prox_pull``: the proximal weight of ``train_mode_prox`` and where its pull enters)."""
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    head = head_groups(cfg, model)
    full = variant.startswith("full")
    cfg = OmegaConf.merge(cfg, {"finetune": {"part": "full" if full else "head",
                                             "head_features": "train_mode" if variant.startswith("train_mode") else "eval"}})
    accuracies = []
    for pid in range(fed.num_clients):
        model.load_state_dict(start)
        rt = ClientRuntime(cfg=cfg, partition_id=pid, device=torch.device("cpu"),
                           train=train_all.subset(torch.as_tensor(fed.client_train[pid])),
                           test=test_all.subset(torch.as_tensor(fed.client_test[pid])),
                           model=model, head=head, initial_state=start, state=RecordDict())
        if variant.endswith("_prox"):
            ft = cfg.finetune
            head_params = list(model.parameters()) if full else [
                p for name in head for p in model.get_submodule(name).parameters()]
            trained = {id(p) for p in head_params}
            for p in model.parameters():
                p.requires_grad_(id(p) in trained)
            train(model, rt.train, rt.optimizer(int(cfg.rounds), lr=ft.lr), int(cfg.train.batch_size),
                  rt.generator(int(cfg.rounds) + 1, 7919), epochs=int(ft.epochs), params=head_params,
                  prox_mu=prox_mu, prox_pull=prox_pull, augment=rt.augment)
            for p in model.parameters():
                p.requires_grad_(True)
            accuracies.append(float(rt.evaluate_local()["accuracy"]))
        else:
            out = finetune(rt, RecordDict({ARRAYS: ArrayRecord(start)}))[METRICS]
            accuracies.append(float(out["accuracy_after"]))
    model.load_state_dict(start)
    return accuracies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders of fedrep_table1_cifar10 with a checkpoint")
    parser.add_argument("--prox-mu", type=float, default=0.1, help="mu of the *_prox variants (default 0.1)")
    parser.add_argument("--prox-pull", choices=PROX_PULLS, default="after_momentum",
                        help="where the *_prox variants' pull enters (default after_momentum, the official optimizer)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated variants to run (default all); others already in the json for a run are kept")
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    torch.set_num_threads(1)
    results = json.loads(OUT.read_text()) if OUT.is_file() else {}
    for run in args.runs:
        run = run.resolve()
        t0 = time.time()
        model, _ = model_from_run(run)
        cfg = OmegaConf.create(checkpoint.read(run, str(run))["config"])
        fed = build_federated_data(cfg.data, int(cfg.seed))
        train_all, test_all = tensors(fed.bundle)
        summary = json.loads((run / "summary.json").read_text())
        key = str(run.relative_to(REPO)) if run.is_relative_to(REPO) else str(run)
        kept = results.get(key, {})  # variants measured before with the same proximal term stay
        entry = kept if (kept.get("prox_mu"), kept.get("prox_pull")) == (args.prox_mu, args.prox_pull) else {}
        entry.update({"algorithm": str(cfg.algorithm), "seed": int(cfg.seed), "augment": str(cfg.train.augment),
                      "run_finetune_accuracy_after": summary.get("finetune_accuracy_after"), "prox_mu": args.prox_mu,
                      "prox_pull": args.prox_pull})
        for variant in args.variants:
            acc = finetuned_accuracy(cfg, model, fed, train_all, test_all, variant, args.prox_mu, args.prox_pull)
            entry[variant] = {"mean": statistics.fmean(acc), "std_over_clients": statistics.stdev(acc)}
        entry["seconds"] = round(time.time() - t0, 1)
        results[key] = entry
        OUT.write_text(json.dumps(results, indent=1) + "\n")
    print("| run | in the run (eval) | eval | train_mode | train_mode + prox | full | full + prox | prox mu | prox pull |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, e in results.items():
        print(f"| {name} | {100 * e['run_finetune_accuracy_after']:.2f} | "
              + " | ".join(f"{100 * e[v]['mean']:.2f}" if v in e else "–" for v in VARIANTS)
              + f" | {e.get('prox_mu', 0.1):g} | {e.get('prox_pull', 'gradient')} |")


if __name__ == "__main__":
    main()
