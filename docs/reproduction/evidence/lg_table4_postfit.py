"""Evidence: LG-FedAvg Table 4's post-fit anomaly (docs/reproduction/lg_table4_adult/table.md).

Question. With LG-FedAvg+Adv (representation trained with the penalty -lambda * L_adv,
lambda = 30 per attribute) the adversary co-trained on the device sits at chance (AUC ~50),
but the post-fit check (a fresh adversary trained 10 epochs on the frozen representation)
recovers race and sex *better* than from the unpenalised LG-FedAvg representation. Bug,
protocol difference or real finding?

What this script does (single-device stand-in of the federated run, no Flower):

* data: the run's own config (conf/base.yaml + conf/experiment/lg_fair_adult.yaml, read with
  OmegaConf only) and the repo's data layer (``build_federated_data``: adult_split=fairness,
  10 i.i.d. devices, partition seed 0, the partition of the documented run); seed ``s`` trains
  device ``s`` (1,500 train rows, its 1,500 matched local test rows);
* model: ``adult_fair`` from the model registry (``build_model``), initialised with
  ``torch.manual_seed(s)``;
* schedule, as one device sees it in the run: 10 pre-train epochs of the model (no penalty),
  10 of the adversary alone (``train_fair(model_step=False)``), then 10 rounds x 10 local
  epochs = 100 joint epochs (``train_fair``), SGD lr 0.1, momentum 0.5, batch 32. The
  federated averaging of the classifier g over the 10 devices is absent: here g is trained
  on the one device only. ``train_fair`` is called once per epoch (its SGD momentum buffers
  restart every epoch instead of every round; with momentum 0.5 this is immaterial);
* variants (``VARIANTS``): ``plain`` (LG-FedAvg, no penalty); ``max30`` (LG-FedAvg+Adv as the
  run: the repo's ``train_fair(penalize=True)``, the model minimises L_g - mean_j lambda_j L_a,j,
  lambda = 30); ``max3`` (lambda = 3); ``max30_adv5`` (a stronger adversary: 5 adversary steps
  per model step); ``conf_half1`` / ``conf_prior3`` / ``conf_prior10`` (a confusion penalty
  instead: the model minimises L_g + mean_j lambda_j BCE(a_j(h), t_j) with the constant target
  t = 1/2 or t = the attribute's train base rate). ``max30_advscaled`` (the official code's
  lambda-scaled adversary loss) is not run by default: it diverges (NaN) in the first joint epoch;
* tracked every epoch: the co-trained adversary's AUC per attribute on the device's test rows
  (``fairness_metrics``) and its test BCE; every 10 epochs (a "round"): the post-fit AUC
  (``postfit_adversary_auc``, 10 epochs, as the run);
* probes at the end, each trained on the device's train rows and scored (ROC-AUC) on its
  test rows, on the representation h and on the raw 93 inputs: the repo's post-fit check
  with 10 and 100 epochs (on the raw inputs the same function with a 93-32-32-32-2 adversary),
  a converged scikit-learn logistic regression on standardised features, a gradient-boosted
  tree ensemble (HistGradientBoosting, early stopping), and a logistic regression on the
  co-trained adversary's own last hidden layer (is the information still in the adversary,
  with its output layer turned the wrong way?). Also the co-trained adversary's AUC with
  dropout on (train mode), as it was trained.

Run (one thread; about 5 CPU-minutes, 10-16 minutes wall on a shared, loaded 2-core machine):

    cd /work/main && . .venv/bin/activate
    python docs/reproduction/evidence/lg_table4_postfit.py

Writes ``lg_table4_postfit.json`` next to itself and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn import functional as F

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from task.data.federated_data import build_federated_data
from task.learning.engine import OptimizerConfig, TensorData, step_batches
from task.learning.fairness import (
    ATTRIBUTES,
    adversary_loss,
    attribute_matrix,
    fairness_metrics,
    postfit_adversary_auc,
    representations,
    train_fair,
)
from task.learning.models import FairMLP, build_model

OUT = Path(__file__).with_suffix(".json")
#: name: (penalty, lambda per attribute; None = the config's fair.lambdas, 30 each)
VARIANTS: dict[str, tuple[str, float | None]] = {
    "plain": ("none", None),           # LG-FedAvg
    "max30": ("max", None),            # LG-FedAvg+Adv, as the run: -lambda * L_adv
    "max3": ("max", 3.0),              # the same penalty, 10x weaker
    "max30_adv5": ("max_adv5", None),  # a stronger adversary: 5 adversary steps per model step
    "max30_advscaled": ("max_advscaled", None),  # the adversary minimises lambda * L_adv (official); diverges
    "conf_half1": ("half", 1.0),       # confusion: adversary output pushed to 1/2
    "conf_prior3": ("prior", 3.0),     # confusion: adversary output pushed to the attribute's base rate
    "conf_prior10": ("prior", 10.0),
}
DEFAULT_VARIANTS = [v for v in VARIANTS if v != "max30_advscaled"]  # that one diverges (NaN) with SGD lr 0.1


def run_config():
    """conf/base.yaml merged with the experiment file (no schema, no Flower); data.root resolved."""
    cfg = OmegaConf.merge(OmegaConf.load(REPO / "conf" / "base.yaml"),
                          OmegaConf.load(REPO / "conf" / "experiment" / "lg_fair_adult.yaml"))
    cfg.data.root = str((REPO / str(cfg.data.root)).resolve())
    return cfg


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(labels, scores))


def train_custom(model: FairMLP, data: TensorData, optimizer: OptimizerConfig, batch_size: int,
                 generator: torch.Generator, epochs: int, lambdas: list[float], penalty: str,
                 target: torch.Tensor | None = None, adv_steps: int = 1, adv_scaled: bool = False) -> None:
    """``train_fair(penalize=True)``'s loop (same batches, optimisers and order) with one change:

    * ``penalty="confusion"``: the model minimises L_g + mean_j lambda_j BCE(a_j(h), target_j),
      pushing the adversary's output towards a constant ``target`` (1/2, or the attribute's
      base rate) whatever the sample's attribute;
    * ``penalty="max"`` with ``adv_steps`` > 1: before each model step the adversary takes
      ``adv_steps`` steps, the extra ones on random batches (a stronger adversary, the direction
      of the official code's adversary epoch per model batch); with ``adv_scaled`` the
      adversary minimises the lambda-weighted loss (the official code's; with SGD its step x lambda).
    """
    adv_params = list(model.adversary.parameters())
    adv_ids = {id(p) for p in adv_params}
    adv_opt = optimizer.build(adv_params, model)
    model_opt = optimizer.build([p for p in model.parameters() if id(p) not in adv_ids], model)
    lam = torch.as_tensor(lambdas, dtype=torch.float32)
    model.train()
    for idx in step_batches(len(data), batch_size, generator, data.x.device, epochs, None):
        xb, yb, zb = data.x[idx], data.y[idx], data.z[idx]
        h = model.representation(xb)
        for k in range(adv_steps):
            if k == 0:
                h_adv, z_adv = h.detach(), zb
            else:
                extra = torch.randint(len(data), (batch_size,), generator=generator)
                with torch.no_grad():
                    h_adv, z_adv = model.representation(data.x[extra]), data.z[extra]
            adv_opt.zero_grad(set_to_none=True)
            adversary_loss(model, h_adv, z_adv, lam if adv_scaled else None).backward()
            adv_opt.step()
        model_opt.zero_grad(set_to_none=True)
        if penalty == "confusion":
            loss = F.cross_entropy(model.classify(h), yb) + adversary_loss(model, h, target.expand_as(zb), lam)
        else:
            loss = F.cross_entropy(model.classify(h), yb) - adversary_loss(model, h, zb, lam)
        loss.backward()
        model_opt.step()


class RawInput(nn.Module):
    """Stand-in 'model' whose representation is the raw input, so that the repo's own
    ``postfit_adversary_auc`` trains a fresh (93-32-32-32-2) adversary on the inputs."""

    classifier_groups = ("input",)

    def __init__(self, n_in: int, n_out: int, hidden: int = 32):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(3):
            layers += [nn.Linear(n_in if i == 0 else hidden, hidden), nn.ReLU()]
        self.adversary = nn.Sequential(*layers, nn.Linear(hidden, n_out))

    def features(self, x: torch.Tensor, head) -> torch.Tensor:
        return x


def sklearn_probes(f_train: np.ndarray, z_train: np.ndarray, f_test: np.ndarray, z_test: np.ndarray,
                   seed: int, trees: bool = True) -> dict[str, float]:
    """Converged logistic regression (standardised features) and gradient-boosted trees, per attribute."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    out = {}
    for j, name in enumerate(ATTRIBUTES):
        lr = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=5000))
        lr.fit(f_train, z_train[:, j])
        out[f"logreg_{name}"] = auc(z_test[:, j], lr.predict_proba(f_test)[:, 1])
        if not trees:
            continue
        gb = HistGradientBoostingClassifier(max_iter=200, learning_rate=0.05, early_stopping=True,
                                            validation_fraction=0.2, random_state=seed)
        gb.fit(f_train, z_train[:, j])
        out[f"hgb_{name}"] = auc(z_test[:, j], gb.predict_proba(f_test)[:, 1])
    return out


@torch.no_grad()
def cotrained_adversary(model: FairMLP, data: TensorData, train_mode: bool = False) -> dict[str, float]:
    """The co-trained adversary on ``data``: AUC and BCE per attribute (eval mode unless
    ``train_mode``: dropout on in the representation, as during training)."""
    if train_mode:
        model.train()
        with torch.random.fork_rng():  # the dropout masks leave the global stream alone
            torch.manual_seed(12345)
            h = model.representation(data.x)
    else:
        h = representations(model, data.x)
    logits = model.adversary(h)
    bce = F.binary_cross_entropy_with_logits(logits, data.z, reduction="none").mean(0)
    out = {}
    for j, name in enumerate(ATTRIBUTES):
        out[f"auc_{name}"] = auc(data.z[:, j].numpy(), logits[:, j].numpy())
        out[f"bce_{name}"] = float(bce[j])
    model.eval()
    return out


@torch.no_grad()
def adversary_hidden(model: FairMLP, x: torch.Tensor) -> np.ndarray:
    """The co-trained adversary's last hidden layer (input of its output layer)."""
    h = representations(model, x)
    return model.adversary[:-1](h).numpy()


def run_one(variant: str, seed: int, train: TensorData, test: TensorData, cfg, joint_epochs: int) -> dict:
    """Train one device model with ``variant``'s penalty (schedule above) and probe it."""
    t0 = time.perf_counter()
    penalty, lam = VARIANTS[variant]
    lambdas = [float(v) for v in cfg.fair.lambdas] if lam is None else [lam] * len(ATTRIBUTES)
    opt = OptimizerConfig(lr=float(cfg.train.lr), momentum=float(cfg.train.momentum))
    bs = int(cfg.train.batch_size)
    pre, post = int(cfg.fair.pretrain_epochs), int(cfg.fair.postfit_epochs)
    torch.manual_seed(seed)
    model = build_model(str(cfg.model.name), (train.x.shape[1],), 2)
    gen = torch.Generator().manual_seed(1000 + seed)
    probe_gen = torch.Generator().manual_seed(2000 + seed)  # post-fit probes: never the training stream
    train_fair(model, train, opt, bs, gen, pre, lambdas, penalize=False)
    train_fair(model, train, opt, bs, gen, pre, lambdas, penalize=False, model_step=False)
    per_epoch: list[dict] = []
    per_round: list[dict] = []

    def log_epoch(epoch: int) -> None:
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            raise FloatingPointError(f"{variant}: the parameters are no longer finite after joint epoch {epoch}")
        m = fairness_metrics(model, test, ATTRIBUTES)
        c = cotrained_adversary(model, test)
        h = representations(model, test.x)
        per_epoch.append({"epoch": epoch, "class_auc": m["class_auc"],
                          **{f"adv_auc_{a}": m[f"adversary_auc_{a}"] for a in ATTRIBUTES},
                          **{f"adv_bce_{a}": c[f"bce_{a}"] for a in ATTRIBUTES},
                          "h_std": float(h.std(0).mean())})

    def log_round(epoch: int) -> None:
        r = postfit_adversary_auc(model, train, test, ATTRIBUTES, opt, bs, post, probe_gen)
        per_round.append({"epoch": epoch, **r})

    def one_epoch() -> None:
        if penalty in ("half", "prior"):
            target = train.z.mean(0) if penalty == "prior" else torch.full((train.z.shape[1],), 0.5)
            train_custom(model, train, opt, bs, gen, 1, lambdas, "confusion", target)
        elif penalty in ("max_adv5", "max_advscaled"):
            train_custom(model, train, opt, bs, gen, 1, lambdas, "max", adv_steps=5 if penalty == "max_adv5" else 1,
                         adv_scaled=penalty == "max_advscaled")
        else:
            train_fair(model, train, opt, bs, gen, 1, lambdas, penalize=penalty == "max")

    log_epoch(0)
    log_round(0)
    try:
        for epoch in range(1, joint_epochs + 1):
            one_epoch()
            log_epoch(epoch)
            if epoch % int(cfg.train.local_epochs) == 0:
                log_round(epoch)
    except FloatingPointError as err:
        return {"diverged": str(err), "per_epoch": per_epoch, "per_round": per_round}

    # final probes on the frozen representation
    model.eval()
    final = {f"cotrained_auc_{a}": per_epoch[-1][f"adv_auc_{a}"] for a in ATTRIBUTES}
    final["class_auc"] = per_epoch[-1]["class_auc"]
    with torch.no_grad():
        final["class_acc"] = float((model.classify(representations(model, test.x)).argmax(1) == test.y)
                                   .float().mean())
    final.update({f"cotrained_bce_{a}": per_epoch[-1][f"adv_bce_{a}"] for a in ATTRIBUTES})
    tm = cotrained_adversary(model, test, train_mode=True)
    final.update({f"cotrained_dropout_auc_{a}": tm[f"auc_{a}"] for a in ATTRIBUTES})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for epochs in (post, 100):
        r = postfit_adversary_auc(model, train, test, ATTRIBUTES, opt, bs, epochs, probe_gen)
        final.update({f"postfit{epochs}_{a}": r[f"postfit_auc_{a}"] for a in ATTRIBUTES})
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), "the post-fit check changed the model"
    h_tr, h_te = representations(model, train.x).numpy(), representations(model, test.x).numpy()
    final.update(sklearn_probes(h_tr, train.z.numpy(), h_te, test.z.numpy(), seed))
    a_tr, a_te = adversary_hidden(model, train.x), adversary_hidden(model, test.x)
    hid = sklearn_probes(a_tr, train.z.numpy(), a_te, test.z.numpy(), seed, trees=False)
    final.update({f"advhidden_{k}": v for k, v in hid.items()})
    final["h_std"] = float(h_te.std(0).mean())
    final["seconds"] = time.perf_counter() - t0
    return {"final": final, "per_epoch": per_epoch, "per_round": per_round}


def raw_probes(seed: int, train: TensorData, test: TensorData, cfg) -> dict[str, float]:
    opt = OptimizerConfig(lr=float(cfg.train.lr), momentum=float(cfg.train.momentum))
    bs, post = int(cfg.train.batch_size), int(cfg.fair.postfit_epochs)
    gen = torch.Generator().manual_seed(3000 + seed)
    stub = RawInput(train.x.shape[1], len(ATTRIBUTES))
    out = {}
    for epochs in (post, 100):
        r = postfit_adversary_auc(stub, train, test, ATTRIBUTES, opt, bs, epochs, gen)
        out.update({f"postfit{epochs}_{a}": r[f"postfit_auc_{a}"] for a in ATTRIBUTES})
    out.update(sklearn_probes(train.x.numpy(), train.z.numpy(), test.x.numpy(), test.z.numpy(), seed))
    prior = train.z.mean(0).expand_as(test.z)  # a constant predictor at the train base rates: the chance-level BCE
    bce = F.binary_cross_entropy(prior, test.z, reduction="none").mean(0)
    out.update({f"base_rate_bce_{a}": float(bce[j]) for j, a in enumerate(ATTRIBUTES)})
    return out


def summarise(results: dict) -> dict:
    """Mean and standard deviation over seeds of every final number, per variant (and raw)."""
    summary: dict = {}
    for name, per_seed in results.items():
        diverged = {seed: r["diverged"] for seed, r in per_seed.items() if "diverged" in r}
        if diverged:
            summary[name] = {"diverged": diverged}
            continue
        finals = [r.get("final", r) for r in per_seed.values()]
        summary[name] = {k: {"mean": float(np.mean([f[k] for f in finals])),
                             "std": float(np.std([f[k] for f in finals], ddof=1)) if len(finals) > 1 else 0.0}
                         for k in finals[0]}
    # co-trained adversary behaviour over the joint epochs (after the first round)
    for v in VARIANTS:
        if v not in results or "diverged" in summary[v]:
            continue
        stats = {}
        first = min(11, len(next(iter(results[v].values()))["per_epoch"]) - 1)  # after the first round
        for a in ATTRIBUTES:
            aucs = np.array([[e[f"adv_auc_{a}"] for e in r["per_epoch"][first:]] for r in results[v].values()])
            stats[f"epochs_auc_below_0.4_{a}"] = float((aucs < 0.4).mean())
            stats[f"epochs_auc_above_0.6_{a}"] = float((aucs > 0.6).mean())
            stats[f"mean_abs_auc_minus_half_{a}"] = float(np.abs(aucs - 0.5).mean())
            stats[f"mean_max_auc_1_minus_auc_{a}"] = float(np.maximum(aucs, 1 - aucs).mean())
            bces = np.array([[e[f"adv_bce_{a}"] for e in r["per_epoch"][first:]] for r in results[v].values()])
            stats[f"median_bce_{a}"] = float(np.median(bces))
        summary[v]["cotrained_over_epochs"] = stats
    return summary


COLUMNS = [
    ("class acc", "class_acc"), ("class AUC", "class_auc"),
    ("co-trained adv AUC", "cotrained_auc"), ("co-trained, dropout on", "cotrained_dropout_auc"),
    ("co-trained adv BCE", "cotrained_bce"),
    ("post-fit 10 ep (the run's check)", "postfit10"), ("post-fit 100 ep", "postfit100"),
    ("logistic regression", "logreg"), ("boosted trees", "hgb"),
    ("LR on adversary's last hidden layer", "advhidden_logreg"),
]


def _cell(s: dict, key: str) -> str:
    scale, fmt = (1.0, "{:.2f}±{:.2f}") if "bce" in key else (100.0, "{:.1f}±{:.1f}")
    if key in s:
        return fmt.format(scale * s[key]["mean"], scale * s[key]["std"])
    if f"{key}_race" in s:
        return " / ".join(fmt.format(scale * s[f"{key}_{a}"]["mean"], scale * s[f"{key}_{a}"]["std"])
                          for a in ATTRIBUTES)
    return "–"


def table(summary: dict) -> str:
    """Markdown: one row per variant (and the raw inputs), AUCs as race / sex, mean±std over seeds."""
    head = "| variant (λ) | " + " | ".join(label for label, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for name in (*VARIANTS, "raw_input"):
        if name in summary and "diverged" not in summary[name]:
            lam = VARIANTS[name][1] if name in VARIANTS else None
            label = name if name not in VARIANTS or VARIANTS[name][0] == "none" else f"{name} ({lam or 30:g})"
            keys = [("base_rate_bce" if name == "raw_input" and key == "cotrained_bce" else key) for _, key in COLUMNS]
            lines.append(f"| {label} | " + " | ".join(_cell(summary[name], key) for key in keys) + " |")
    return "\n".join(lines)


def over_epochs_table(summary: dict) -> str:
    """Markdown: the co-trained adversary over joint epochs 11-100 (per epoch end, pooled over seeds)."""
    keys = [("AUC<0.4", "epochs_auc_below_0.4"), ("AUC>0.6", "epochs_auc_above_0.6"),
            ("mean max(AUC,1-AUC)", "mean_max_auc_1_minus_auc"), ("median BCE", "median_bce")]
    lines = ["| variant | " + " | ".join(k for k, _ in keys) + " |", "|" + "---|" * (len(keys) + 1)]
    for name in VARIANTS:
        if name in summary and "diverged" not in summary[name]:
            st = summary[name]["cotrained_over_epochs"]
            cells = [" / ".join(f"{st[f'{key}_{a}']:.2f}" for a in ATTRIBUTES) for _, key in keys]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rounds_table(results: dict) -> str:
    """Markdown: the 10-epoch post-fit AUC (race / sex, mean over seeds) after pre-training and each round."""
    names = [n for n in VARIANTS if n in results and not any("diverged" in r for r in results[n].values())]
    epochs = [r["epoch"] for r in next(iter(results[names[0]].values()))["per_round"]]
    lines = ["| variant | " + " | ".join(f"ep {e}" for e in epochs) + " |", "|" + "---|" * (len(epochs) + 1)]
    for name in names:
        runs = list(results[name].values())
        cells = []
        for i in range(len(epochs)):
            cells.append("/".join(f"{100 * np.mean([r['per_round'][i][f'postfit_auc_{a}'] for r in runs]):.0f}"
                                  for a in ATTRIBUTES))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rounded(obj):
    """``obj`` with every float rounded to 4 decimals (a smaller JSON)."""
    if isinstance(obj, float):
        return round(obj, 4)
    if isinstance(obj, dict):
        return {k: rounded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v) for v in obj]
    return obj


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--joint-epochs", type=int, default=None, help="default: rounds x local_epochs (100)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 5 joint epochs, one seed")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = run_config()
    joint = args.joint_epochs or int(cfg.rounds) * int(cfg.train.local_epochs)
    seeds = args.seeds
    if args.quick:
        joint, seeds = 5, seeds[:1]
        cfg.train.local_epochs = 5
    with tempfile.TemporaryDirectory() as cache:  # partition cache: nothing written outside
        cfg.data.cache_dir = cache
        fed = build_federated_data(OmegaConf.to_container(cfg.data), seed=0)
    b = fed.bundle

    def tensors(split, idx) -> TensorData:
        attrs = {k: v[idx] for k, v in split.attributes.items()}
        return TensorData.from_arrays(split.x[idx], split.y[idx], torch.device("cpu"), attribute_matrix(attrs))

    checks = {}
    for seed in seeds:  # the device's train and test rows: different halves of adult.data (no shared row)
        tr_rows = {row.tobytes() for row in b.train.x[fed.client_train[seed]]}
        checks[str(seed)] = {
            "test_rows_with_a_feature_vector_identical_to_a_train_row":
                int(sum(row.tobytes() in tr_rows for row in b.test.x[fed.client_test[seed]])),
            "train_base_rates": {a: float(b.train.attributes[a][fed.client_train[seed]].mean()) for a in ATTRIBUTES},
            "test_base_rates": {a: float(b.test.attributes[a][fed.client_test[seed]].mean()) for a in ATTRIBUTES},
        }
    results: dict = {v: {} for v in args.variants}
    results["raw_input"] = {}
    t0 = time.perf_counter()
    for seed in seeds:
        train, test = tensors(b.train, fed.client_train[seed]), tensors(b.test, fed.client_test[seed])
        results["raw_input"][str(seed)] = raw_probes(seed, train, test, cfg)
        for v in args.variants:
            results[v][str(seed)] = run_one(v, seed, train, test, cfg, joint)
            if "diverged" in results[v][str(seed)]:
                print(f"seed {seed} {v:12s} diverged: {results[v][str(seed)]['diverged']}", flush=True)
                continue
            f = results[v][str(seed)]["final"]
            print(f"seed {seed} {v:12s} {f['seconds']:.0f}s  co-trained {100 * f['cotrained_auc_race']:.1f}/"
                  f"{100 * f['cotrained_auc_sex']:.1f}  post-fit10 {100 * f['postfit10_race']:.1f}/"
                  f"{100 * f['postfit10_sex']:.1f}  logreg {100 * f['logreg_race']:.1f}/{100 * f['logreg_sex']:.1f}",
                  flush=True)
    summary = summarise(results)
    meta = {"command": " ".join(["python", "docs/reproduction/evidence/lg_table4_postfit.py", *sys.argv[1:]]),
            "variants": {v: VARIANTS[v] for v in args.variants}, "seeds": seeds, "devices": seeds, "partition_seed": 0, "joint_epochs": joint,
            "pretrain_epochs": int(cfg.fair.pretrain_epochs), "lambdas": list(cfg.fair.lambdas),
            "rows_per_device": {"train": len(fed.client_train[seeds[0]]), "test": len(fed.client_test[seeds[0]])},
            "checks": checks, "torch_threads": torch.get_num_threads(), "seconds": time.perf_counter() - t0}
    args.out.write_text(json.dumps(rounded({"meta": meta, "summary": summary, "runs": results}), separators=(",", ":")))
    print(table(summary), over_epochs_table(summary), rounds_table(results), sep="\n\n")
    print(f"wrote {args.out} ({meta['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
