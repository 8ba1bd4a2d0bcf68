"""Fair local representations (LG-FedAvg Section 3.3, Appendix A, Section 5.3).

A :class:`~task.learning.models.FairMLP` device model has a representation ``ℓ`` (``fc1..fc3``), a
classifier ``g`` on it and an adversary ``a`` predicting the binary protected attributes
``p`` from the representation. With L_g the classification loss and L_a the adversary's
binary cross-entropy, each training step alternates (eq. 25, coordinate descent):

1. the adversary minimises L_a on the detached representation (it maximises
   E = L_g − λ·L_a);
2. the model (``ℓ`` and ``g``) minimises L_g − mean_j λ_j·L_a,j when ``penalize``
   (LG-FedAvg+Adv; the λ-weighted mean over attributes, as the official code), else L_g. The penalty reaches only the representation: ``g`` does not touch the
   adversary's input.

The official code (``main_fair.py``) trains the adversary for a whole epoch and then the
classifier on one batch, and also multiplies the adversary's own loss by λ; here both steps
run on every batch and the adversary minimises the plain L_a, as in the paper's eq. 25.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from task.learning.engine import OptimizerConfig, TensorData, TrainResult, step_batches
from task.learning.inference import predict_features


#: The protected attributes, in the order of ``TensorData.z``'s columns and the adversary's outputs.
ATTRIBUTES = ("race", "sex")


def attribute_matrix(attributes: dict[str, np.ndarray] | None) -> np.ndarray | None:
    """The :data:`ATTRIBUTES` of a split as a float (N, 2) matrix (None when a split lacks them)."""
    if not attributes or any(name not in attributes for name in ATTRIBUTES):
        return None
    return np.stack([np.asarray(attributes[name], dtype=np.float32) for name in ATTRIBUTES], axis=1)


def adversary_loss(model: nn.Module, h: torch.Tensor, z: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean binary cross-entropy of the adversary on representation ``h`` (per attribute
    weighted by ``weights`` when given), averaged over samples and attributes."""
    per = F.binary_cross_entropy_with_logits(model.adversary(h), z, reduction="none")
    if weights is not None:
        per = per * weights
    return per.mean()


def train_fair(
    model: nn.Module,
    data: TensorData,
    optimizer: OptimizerConfig,
    batch_size: int,
    generator: torch.Generator,
    epochs: int,
    lambdas: Sequence[float],
    penalize: bool,
    model_step: bool = True,
) -> TrainResult:
    """``epochs`` passes of the alternating updates above (``model_step=False``: adversary only)."""
    if data.z is None:
        raise ValueError("fair training needs the protected attributes of the samples (TensorData.z)")
    adv_params = list(model.adversary.parameters())
    adv_ids = {id(p) for p in adv_params}
    model_params = [p for p in model.parameters() if id(p) not in adv_ids]
    adv_opt, model_opt = optimizer.build(adv_params, model), optimizer.build(model_params, model)
    lam = torch.as_tensor(list(lambdas), dtype=torch.float32, device=data.x.device)
    model.train()
    total = torch.zeros((), device=data.x.device)
    steps = samples = 0
    for idx in step_batches(len(data), batch_size, generator, data.x.device, epochs, None):
        xb, yb, zb = data.x[idx], data.y[idx], data.z[idx]
        h = model.representation(xb)
        adv_opt.zero_grad(set_to_none=True)
        adversary_loss(model, h.detach(), zb).backward()
        adv_opt.step()
        if model_step:
            model_opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model.classify(h), yb)
            if penalize:
                loss = loss - adversary_loss(model, h, zb, lam)
            loss.backward()
            model_opt.step()
            total += loss.detach() * len(idx)
        samples += len(idx)
        steps += 1
    return TrainResult(float(total) / max(samples, 1), steps, samples)


def representations(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The representation ``h`` of every row of ``x`` (eval mode, chunked)."""
    return predict_features(model, model.classifier_groups, x)


def _auc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    """ROC-AUC, or None when ``labels`` hold a single class."""
    from sklearn.metrics import roc_auc_score  # sklearn's import costs ~1.5 s: only where AUCs are computed

    return float(roc_auc_score(labels, scores)) if len(np.unique(labels)) == 2 else None


@torch.no_grad()
def fairness_metrics(model: nn.Module, data: TensorData, attributes: Sequence[str]) -> dict[str, float]:
    """Class ROC-AUC and the adversary's ROC-AUC per protected attribute on ``data``
    (a metric is left out when its labels hold a single class)."""
    h = representations(model, data.x)
    out: dict[str, float] = {}
    class_scores = torch.softmax(model.classify(h), dim=1)[:, 1]
    auc = _auc(data.y.cpu().numpy(), class_scores.cpu().numpy())
    if auc is not None:
        out["class_auc"] = auc
    if data.z is not None:
        adv = torch.sigmoid(model.adversary(h)).cpu().numpy()
        for j, name in enumerate(attributes):
            auc = _auc(data.z[:, j].cpu().numpy(), adv[:, j])
            if auc is not None:
                out[f"adversary_auc_{name}"] = auc
    return out


def postfit_adversary_auc(model: nn.Module, train: TensorData, test: TensorData, attributes: Sequence[str],
                          optimizer: OptimizerConfig, batch_size: int, epochs: int,
                          generator: torch.Generator) -> dict[str, float]:
    """The paper's check: a fresh adversary trained on the frozen representations of
    ``train`` for ``epochs``; its ROC-AUC per attribute on ``test`` (``postfit_auc_<attr>``)."""
    if train.z is None or test.z is None:
        raise ValueError("the post-fit check needs the protected attributes of the samples")
    fresh = _fresh_copy(model.adversary, generator)
    h_train, h_test = representations(model, train.x), representations(model, test.x)
    opt = optimizer.build(list(fresh.parameters()), fresh)
    fresh.train()
    for idx in step_batches(len(train), batch_size, generator, train.x.device, epochs, None):
        opt.zero_grad(set_to_none=True)
        F.binary_cross_entropy_with_logits(fresh(h_train[idx]), train.z[idx]).backward()
        opt.step()
    with torch.no_grad():
        scores = torch.sigmoid(fresh(h_test)).cpu().numpy()
    out = {}
    for j, name in enumerate(attributes):
        auc = _auc(test.z[:, j].cpu().numpy(), scores[:, j])
        if auc is not None:
            out[f"postfit_auc_{name}"] = auc
    return out


def _fresh_copy(module: nn.Module, generator: torch.Generator) -> nn.Module:
    """A copy of ``module`` with every linear layer re-initialised (seeded by ``generator``)."""
    import copy

    fresh = copy.deepcopy(module)
    with torch.no_grad():
        for layer in fresh.modules():
            if isinstance(layer, nn.Linear):
                bound = 1.0 / layer.in_features ** 0.5
                layer.weight.copy_(torch.rand(layer.weight.shape, generator=generator) * 2 * bound - bound)
                layer.bias.copy_(torch.rand(layer.bias.shape, generator=generator) * 2 * bound - bound)
    return fresh
