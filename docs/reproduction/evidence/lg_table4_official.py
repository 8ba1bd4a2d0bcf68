"""Evidence: which of the official LG-FedAvg fairness code's departures move Table 4's numbers.

Question. Our LG-FedAvg on UCI Adult (``lg_table4_adult``) is 1.9 points below the paper's
class accuracy i.i.d. and 3.1 above it non-i.i.d.; the co-trained adversary reads the
attributes about 4 AUC points better than the paper's; LG-FedAvg+Adv loses more accuracy than
the paper's. The official code (pliang279/LG-FedAvg, ``main_fair.py`` and ``models/Update.py``
at commit af89a47, the only commit that has them) departs from the paper's text in four ways
that this script switches on one at a time and together (two change the training:
``frozen_global``, ``cancelled``; two the scoring of the same trained models: ``test_rows``,
``dropout_eval``):

* ``test_rows``: device i is scored on the rows of the test half *at its train indices*
  (``test_data[dict_users_train[idx]]``, main_fair.py l. 278; ``dict_users_test`` is unused):
  random test rows with the overall label mix, where ours are the device's own label mix
  (they differ only non-i.i.d.);
* ``frozen_global``: the global classifier is never trained. Each device trains a
  ``copy.deepcopy(global_clf)`` (l. 374) while the optimiser steps ``global_clf``'s own
  parameters (Adam, l. 352), which get no gradient; the average of the unchanged copies is the
  random initial classifier, every round;
* ``cancelled``: ``loss = L - A; loss.backward(retain_graph=True); A.backward()``
  (Update.py l. 116-123) gives the representation the gradient of L alone (the penalty cancels)
  and never zeroes the adversary's gradient: the adversary steps along the stale gradient of
  its last pre-training batch (plus, without the penalty, the running sum of its own
  gradients, lambda = 0.03); both optimisers plain SGD (no momentum), as the official code;
* ``dropout_eval``: no ``.eval()`` anywhere: scored with dropout on.

The federation is simulated in one process (no Flower): 10 devices, all every round, the
run's own data (``build_federated_data`` with conf/experiment/lg_fair_adult.yaml: i.i.d., or
the table's non-i.i.d. shards), model (``adult_fair``) and training functions (``train_fair``
for the paper's schedule); per device 10 pre-training epochs of the model (no penalty), 10 of
the adversary, then 10 rounds of 10 joint epochs, the global part (g1-g3) averaged after each
round. ``ours`` is that stand-in of our run, to check it lands on the run's numbers.

Run (one thread; about 75 CPU-seconds per run, 16 runs per seed; resumable: runs already in
the JSON are kept):

    cd /work/main && . .venv/bin/activate
    python docs/reproduction/evidence/lg_table4_official.py --seeds 0 1 2

Writes ``lg_table4_official.json`` next to itself after every run and prints the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.nn import functional as F

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from task.data.federated_data import build_federated_data
from task.learning.engine import OptimizerConfig, TensorData, step_batches
from task.learning.fairness import (
    ATTRIBUTES,
    adversary_loss,
    attribute_matrix,
    train_fair,
)
from task.learning.models import FairMLP, build_model

OUT = Path(__file__).with_suffix(".json")
#: training: the switches each run trains with (a run is scored under every evaluation below)
TRAININGS: dict[str, tuple[str, ...]] = {"ours": (), "frozen_global": ("frozen_global",),
                                         "cancelled": ("cancelled",), "both": ("frozen_global", "cancelled")}
#: evaluation: (the official test rows, dropout on)
EVALUATIONS: dict[str, tuple[bool, bool]] = {"ours": (False, False), "test_rows": (True, False),
                                             "dropout_eval": (False, True), "both": (True, True)}
#: the table's non-i.i.d. split (conf/tables/lg_table4_adult.yaml)
SPLITS = {"iid": {}, "noniid": {"partition": "shard", "shards_per_client": 10, "shard_size": 150}}
OFFICIAL_LAMBDA = 0.03  # models/Update.py l. 89: the adversary's weight during federated training


def run_config():
    cfg = OmegaConf.merge(OmegaConf.load(REPO / "conf" / "base.yaml"),
                          OmegaConf.load(REPO / "conf" / "experiment" / "lg_fair_adult.yaml"))
    cfg.data.root = str((REPO / str(cfg.data.root)).resolve())
    return cfg


def global_params(model: FairMLP) -> list[torch.nn.Parameter]:
    return [p for name in model.classifier_groups for p in getattr(model, name).parameters()]


def official_joint_epochs(model: FairMLP, data: TensorData, lr: float, batch_size: int, gen: torch.Generator,
                          epochs: int, penalize: bool, frozen_global: bool) -> None:
    """Update.py's loop: both gradients from ``L -/+ A`` then ``A`` again, the adversary's never zeroed."""
    adv = list(model.adversary.parameters())
    adv_ids = {id(p) for p in adv}
    frozen = {id(p) for p in global_params(model)} if frozen_global else set()
    trained = [p for p in model.parameters() if id(p) not in adv_ids and id(p) not in frozen]
    model_opt, adv_opt = torch.optim.SGD(trained, lr=lr), torch.optim.SGD(adv, lr=lr)
    lam = torch.full((len(ATTRIBUTES),), OFFICIAL_LAMBDA)
    model.train()
    for idx in step_batches(len(data), batch_size, gen, data.x.device, epochs, None):
        for p in model.parameters():  # local_net.zero_grad(), global_net.zero_grad(); never the adversary's
            if p.grad is not None and id(p) not in adv_ids:
                p.grad.zero_()
        h = model.representation(data.x[idx])
        loss = F.cross_entropy(model.classify(h), data.y[idx])
        a = adversary_loss(model, h, data.z[idx], lam)
        (loss - a if penalize else loss).backward(retain_graph=True)
        a.backward()
        model_opt.step()
        adv_opt.step()


def ours_joint_epochs(model: FairMLP, data: TensorData, opt: OptimizerConfig, batch_size: int,
                      gen: torch.Generator, epochs: int, lambdas: list[float], penalize: bool,
                      frozen_global: bool) -> None:
    for p in global_params(model):  # frozen: no gradient, so train_fair's optimiser skips them
        p.requires_grad_(not frozen_global)
    train_fair(model, data, opt, batch_size, gen, epochs, lambdas, penalize=penalize)
    for p in global_params(model):
        p.requires_grad_(True)


@torch.no_grad()
def scores(model: FairMLP, data: TensorData, dropout_eval: bool, seed: int) -> dict[str, float]:
    """Class accuracy, class AUC and the co-trained adversary's AUC (mean of race, sex) on ``data``;
    an AUC is left out when its labels hold one class (as ``fairness_metrics`` does in the run)."""
    from sklearn.metrics import roc_auc_score

    model.train(dropout_eval)
    with torch.random.fork_rng():  # dropout masks (dropout_eval) from their own stream
        torch.manual_seed(seed)
        h = model.representation(data.x)
        logits = model.classify(h)
        adv = torch.sigmoid(model.adversary(h))
    model.eval()

    def auc(labels: torch.Tensor, s: torch.Tensor) -> float | None:
        return float(roc_auc_score(labels.numpy(), s.numpy())) if len(labels.unique()) == 2 else None

    out = {"class_acc": float((logits.argmax(1) == data.y).float().mean())}
    values = {"class_auc": auc(data.y, torch.softmax(logits, 1)[:, 1]),
              **{f"adversary_auc_{a}": auc(data.z[:, j], adv[:, j]) for j, a in enumerate(ATTRIBUTES)}}
    out.update({k: v for k, v in values.items() if v is not None})
    adv_aucs = [out[f"adversary_auc_{a}"] for a in ATTRIBUTES if f"adversary_auc_{a}" in out]
    if adv_aucs:
        out["adversary_auc"] = float(np.mean(adv_aucs))
    return out


def federate(switches: tuple[str, ...], penalize: bool, seed: int, devices: list[tuple[TensorData, ...]],
             cfg) -> dict[str, dict[str, float]]:
    """One LG-FedAvg run of the stand-in; per evaluation, the means over devices of its final scores.
    ``devices``: (train, our local test, the official test rows) per device."""
    official = "cancelled" in switches
    frozen = "frozen_global" in switches
    lr, bs = float(cfg.train.lr), int(cfg.train.batch_size)
    opt = OptimizerConfig(lr=lr, momentum=float(cfg.train.momentum))
    lambdas = [float(v) for v in cfg.fair.lambdas]
    pre, local_epochs, rounds = int(cfg.fair.pretrain_epochs), int(cfg.train.local_epochs), int(cfg.rounds)
    torch.manual_seed(seed)
    init = build_model(str(cfg.model.name), (devices[0][0].x.shape[1],), 2)
    g = [p.detach().clone() for p in global_params(init)]
    models: list[FairMLP | None] = [None] * len(devices)
    gens = [torch.Generator().manual_seed(1000 * seed + i) for i in range(len(devices))]
    for _ in range(rounds):
        replies = []
        for i, (train, *_tests) in enumerate(devices):
            first = models[i] is None
            m = copy.deepcopy(init) if first else models[i]
            with torch.no_grad():
                for p, v in zip(global_params(m), g):
                    p.copy_(v)
            if first:
                train_fair(m, train, opt, bs, gens[i], pre, lambdas, penalize=False)
                train_fair(m, train, opt, bs, gens[i], pre, lambdas, penalize=False, model_step=False)
            if official:
                official_joint_epochs(m, train, lr, bs, gens[i], local_epochs, penalize, frozen)
            else:
                ours_joint_epochs(m, train, opt, bs, gens[i], local_epochs, lambdas, penalize, frozen)
            models[i] = m
            replies.append([p.detach().clone() for p in global_params(m)])
        if not frozen:
            g = [torch.stack(ps).mean(0) for ps in zip(*replies)]
    for m in models:
        with torch.no_grad():
            for p, v in zip(global_params(m), g):
                p.copy_(v)
    out = {}
    for name, (test_rows, dropout) in EVALUATIONS.items():
        finals = [scores(m, dev[2 if test_rows else 1], dropout, 7000 + i) for i, (m, dev) in enumerate(zip(models, devices))]
        # a metric is left out on a device whose test labels hold one class (as in the run): mean over the rest
        out[name] = {k: float(np.mean([f[k] for f in finals if k in f])) for k in sorted(set().union(*finals))}
    return out


def device_data(cfg, split: str) -> list[tuple[TensorData, TensorData, TensorData]]:
    """Per device: its train rows, our local test rows, the official test rows (at its train indices)."""
    data_cfg = OmegaConf.to_container(cfg.data)
    data_cfg.update(SPLITS[split])
    with tempfile.TemporaryDirectory() as cache:
        data_cfg["cache_dir"] = cache
        fed = build_federated_data(data_cfg, seed=0)
    b = fed.bundle

    def tensors(part, idx) -> TensorData:
        attrs = {k: v[idx] for k, v in part.attributes.items()}
        return TensorData.from_arrays(part.x[idx], part.y[idx], torch.device("cpu"), attribute_matrix(attrs))

    return [(tensors(b.train, tr), tensors(b.test, te), tensors(b.test, tr))
            for tr, te in zip(fed.client_train, fed.client_test)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--trainings", nargs="+", choices=list(TRAININGS), default=list(TRAININGS))
    ap.add_argument("--splits", nargs="+", choices=list(SPLITS), default=list(SPLITS))
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = run_config()
    results: dict = json.loads(args.out.read_text())["results"] if args.out.is_file() else {}
    t0 = time.perf_counter()
    for split in args.splits:
        devices = device_data(cfg, split)
        for training in args.trainings:
            for penalize in (False, True):
                key = f"{split}/{training}/{'adv' if penalize else 'plain'}"
                for seed in args.seeds:
                    if str(seed) in results.get(key, {}):
                        continue  # resumable: a finished (split, training, kind, seed) is kept
                    results.setdefault(key, {})[str(seed)] = federate(TRAININGS[training], penalize, seed, devices, cfg)
                    args.out.write_text(json.dumps({"results": results}, indent=1))
                    m = results[key][str(seed)]["ours"]
                    print(f"{key:28s} seed {seed}: acc {100 * m['class_acc']:.2f} auc {100 * m['class_auc']:.2f} "
                          f"adv {100 * m['adversary_auc']:.2f}  ({time.perf_counter() - t0:.0f}s)", flush=True)
    print(table(results))


def table(results: dict) -> str:
    """Markdown: class accuracy / class AUC / adversary AUC, mean ± std over the seeds run."""
    lines = [("| split | training | evaluation | seeds | LG-FedAvg: acc / class AUC / adv AUC | "
              "LG-FedAvg+Adv: acc / class AUC / adv AUC |"), "|---|---|---|---|---|---|"]
    for split in SPLITS:
        for training in TRAININGS:
            for evaluation in EVALUATIONS:
                cells, n = [], 0
                for kind in ("plain", "adv"):
                    per_seed = results.get(f"{split}/{training}/{kind}")
                    if not per_seed:
                        cells.append("–")
                        continue
                    n = len(per_seed)
                    vals = [[100 * r[evaluation][k] for r in per_seed.values()]
                            for k in ("class_acc", "class_auc", "adversary_auc")]
                    cells.append(" / ".join(f"{np.mean(v):.1f}" + (f" ± {np.std(v, ddof=1):.1f}" if len(v) > 1 else "")
                                            for v in vals))
                if n:
                    lines.append(f"| {split} | {training} | {evaluation} | {n} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
