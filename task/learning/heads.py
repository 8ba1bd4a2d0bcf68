"""Training only a model's head with its body frozen: on body features computed once (exact
without augmentation; a small head trains on a CPU copy when the body is on a GPU), in train
mode through the whole model (the official FedRep head epochs), or by an exact least-squares fit."""

from __future__ import annotations

from collections.abc import Sequence
from copy import deepcopy

import torch
from torch import nn

from task.learning.engine import OptimizerConfig, TensorData, TrainResult, train
from task.learning.inference import predict_features


def train_head_on_features(
    model: nn.Module,
    head: Sequence[str],
    data: TensorData,
    optimizer: OptimizerConfig,
    batch_size: int,
    generator: torch.Generator,
    epochs: int | None,
    regression: bool = False,
    steps: int | None = None,
) -> TrainResult:
    """Train only the ``head`` groups of a split model with the body frozen.

    Body features are computed once (eval mode, no augmentation) and the head trains on
    them, which is exact because a frozen body maps each input to fixed features. Under a bf16
    :func:`precision` the features are computed in bf16 and the head trains in float32.
    """
    features = predict_features(model, head, data.x).float()  # bf16 under a bf16 precision context
    head_module = nn.Sequential(*[model.get_submodule(name) for name in head])
    head_data = TensorData(features, data.y)
    with torch.autocast(device_type=features.device.type, enabled=False):  # a small head: autocast only costs
        if features.is_cuda and sum(p.numel() for p in head_module.parameters()) <= SMALL_HEAD:
            return train_copy_on_cpu(head_module, head_data, optimizer, batch_size, generator, epochs, steps, regression)
        return train(head_module, head_data, optimizer, batch_size, generator, epochs=epochs, steps=steps,
                     regression=regression)


def train_head_in_train_mode(
    model: nn.Module,
    head: Sequence[str],
    data: TensorData,
    optimizer: OptimizerConfig,
    batch_size: int,
    generator: torch.Generator,
    epochs: int | None,
    regression: bool = False,
    steps: int | None = None,
    augment: str | None = None,
) -> TrainResult:
    """Train only the ``head`` groups with the body frozen, running the whole model in train
    mode on every batch (dropout active, ``augment`` applied, no feature cache): the official
    FedRep head epochs. The body's parameters stay as they are (its gradients are never formed)."""
    head_params = [p for name in head for p in model.get_submodule(name).parameters()]
    trained = {id(p) for p in head_params}
    frozen = [p for p in model.parameters() if id(p) not in trained and p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        return train(model, data, optimizer, batch_size, generator, epochs=epochs, steps=steps, params=head_params,
                     regression=regression, augment=augment)
    finally:
        for p in frozen:
            p.requires_grad_(True)


#: Heads of at most this many parameters train on the CPU when the body is on a GPU: each SGD step
#: of a small head is all kernel launches and Python there. Measured on an H100 machine for
#: FedRep's CIFAR-10 head (650 parameters, 10 epochs of 50 steps): 0.27-0.52 s on the GPU.
SMALL_HEAD = 1 << 18


def train_copy_on_cpu(module: nn.Module, data: TensorData, optimizer: OptimizerConfig, batch_size: int,
                      generator: torch.Generator, epochs: int | None, steps: int | None = None,
                      regression: bool = False) -> TrainResult:
    """:func:`train` a CPU copy of ``module`` on a CPU copy of ``data`` and copy the result back:
    the same batches (``generator`` is a CPU generator either way) and the same arithmetic up to
    float rounding."""
    copy = deepcopy(module).cpu()
    result = train(copy, TensorData(data.x.cpu(), data.y.cpu()), optimizer, batch_size, generator,
                   epochs=epochs, steps=steps, regression=regression)
    module.load_state_dict(copy.state_dict())
    return result


@torch.no_grad()
def fit_head_least_squares(model: nn.Module, head: Sequence[str], data: TensorData) -> None:
    """Set a single linear head to the least-squares fit of the targets on body features.

    The exact head minimisation of FedRep's linear analysis (regression only): with features
    Z and targets y the head becomes argmin_w ||Z w - y||² (a bias, if any, is fitted too).
    """
    if len(head) != 1 or not isinstance(model.get_submodule(head[0]), nn.Linear):
        raise ValueError(f"exact head fitting needs a single nn.Linear head group, got {list(head)}")
    linear = model.get_submodule(head[0])
    z = predict_features(model, head, data.x).double()
    if linear.bias is not None:
        z = torch.cat([z, torch.ones_like(z[:, :1])], dim=1)
    y = data.y.double().reshape(len(data), -1)
    solution = torch.linalg.lstsq(z, y).solution  # (features [+1], outputs)
    weight = solution[: linear.in_features].T
    linear.weight.copy_(weight.to(linear.weight.dtype))
    if linear.bias is not None:
        linear.bias.copy_(solution[linear.in_features].to(linear.bias.dtype))
