"""Fast local training: client data, batches and the SGD loop.

Client data lives as tensors on the training device; a batch is an index slice of a
seeded permutation (no DataLoader is built per round). Everything here is plain PyTorch.
Scoring a model is in :mod:`task.learning.inference`, training only its head in
:mod:`task.learning.heads`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from task.data.datasets.images import ImageArray


@dataclass(frozen=True)
class OptimizerConfig:
    """SGD settings of one local training call."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    decay_biases: bool = True  # False: parameters named *bias* train without weight decay

    def build(self, params: Sequence[nn.Parameter], model: nn.Module) -> torch.optim.Optimizer:
        """A fresh SGD optimizer over ``params`` of ``model`` (momentum buffers start at zero).
        Without ``decay_biases``, the parameters whose names in ``model`` contain ``bias`` form a
        group without weight decay (the official FedRep code's SGD, models/Update.py)."""
        params = list(params)
        groups: list = params
        if not self.decay_biases:
            biases = {id(p) for name, p in model.named_parameters() if "bias" in name}
            groups = [{"params": [p for p in params if id(p) not in biases]},
                      {"params": [p for p in params if id(p) in biases], "weight_decay": 0.0}]
        return torch.optim.SGD(
            groups,
            lr=self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            nesterov=self.nesterov,
        )


@dataclass
class TensorData:
    """Inputs and targets of one client split, already on the training device.

    ``z`` optionally holds per-sample protected attributes, float (N, attributes). A dataset
    stored as uint8 images (:meth:`stored_images`) carries ``normalize`` = (mean, std) per
    channel and is only a source of :meth:`subset`, which returns float32 inputs.
    """

    x: torch.Tensor
    y: torch.Tensor
    z: torch.Tensor | None = None
    normalize: tuple[torch.Tensor, torch.Tensor] | None = None
    subset_format: torch.memory_format = torch.contiguous_format  # of stored images' float subsets

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @classmethod
    def from_arrays(cls, x, y: np.ndarray, device: torch.device,
                    z: np.ndarray | None = None) -> TensorData:
        """Copy numpy arrays (an :class:`ImageArray` converted to float32) to ``device`` once."""
        zt = torch.as_tensor(z, dtype=torch.float32).to(device) if z is not None else None
        return cls(torch.as_tensor(np.asarray(x)).to(device), torch.as_tensor(y).to(device), zt)

    @classmethod
    def stored_images(cls, x: ImageArray, y: np.ndarray, device: torch.device,
                      z: np.ndarray | None = None) -> TensorData:
        """The uint8 images of ``x`` on ``device`` (a quarter of float32's memory; on a CPU the
        numpy array's own memory), converted to float32 per :meth:`subset`."""
        with warnings.catch_warnings():  # a read-only (e.g. memory-mapped) array is never written here
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = cls.from_arrays(x.raw, y, device, z)
        mean = np.zeros(x.shape[1], np.float32) if x.mean is None else x.mean
        std = np.ones(x.shape[1], np.float32) if x.std is None else x.std
        data.normalize = (torch.as_tensor(mean).to(device), torch.as_tensor(std).to(device))
        return data

    def subset(self, idx: torch.Tensor) -> TensorData:
        """The samples at ``idx`` (float32 inputs, bit-identical to :class:`ImageArray`'s)."""
        x = self.x[idx]
        if self.normalize is not None:
            mean, std = (t.view(-1, 1, 1) for t in self.normalize)  # per channel of (N, C, H, W)
            x = x.to(torch.float32, memory_format=self.subset_format).mul_(1.0 / 255.0).sub_(mean).div_(std)
        return TensorData(x, self.y[idx], self.z[idx] if self.z is not None else None)


@dataclass
class TrainResult:
    """What one local training call did."""

    mean_loss: float
    steps: int
    samples: int


#: ``train.precision`` -> the autocast dtype of model computation (None: full float32).
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


def precision(name: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context in which a client computes at ``train.precision`` ``name``: bf16 autocast
    (float32 weights, optimizer state and loss; matrix products and convolutions in bfloat16)
    or plain float32. :func:`task.learning.inference.evaluate` always scores in float32 inside either."""
    dtype = PRECISIONS[name]
    if dtype is None:
        return contextlib.nullcontext()
    # No weight-cast cache: the context spans whole training loops, and a cached bf16 copy of a
    # weight would go stale at the first optimizer step (training would diverge).
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=False)


def fast_layout(model: nn.Module, data: Sequence[TensorData]) -> None:
    """Channels-last memory format for a model with 2-D convolutions and for its image data,
    in place: faster convolutions on CPUs (oneDNN) and on GPUs, the same numbers up to rounding."""
    if not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return
    model.to(memory_format=torch.channels_last)
    for split in data:
        if split.normalize is not None:
            split.subset_format = torch.channels_last  # stored uint8 images stay as they are
        elif split.x.dim() == 4:
            split.x = split.x.contiguous(memory_format=torch.channels_last)


def loss_function(regression: bool):
    """Cross-entropy for classification, mean squared error for regression."""
    if regression:
        return lambda out, y: F.mse_loss(out.squeeze(-1), y)
    return F.cross_entropy


def batch_slices(
    num_examples: int, batch_size: int, generator: torch.Generator, device: torch.device
) -> Iterator[torch.Tensor]:
    """Index batches of one epoch: slices of a seeded permutation (last batch may be short)."""
    perm = torch.randperm(num_examples, generator=generator).to(device)
    for start in range(0, num_examples, batch_size):
        yield perm[start : start + batch_size]


def step_batches(
    num_examples: int,
    batch_size: int,
    generator: torch.Generator,
    device: torch.device,
    epochs: int | None,
    steps: int | None,
) -> Iterator[torch.Tensor]:
    """Batches for ``epochs`` full passes, or exactly ``steps`` batches across passes."""
    if steps is None:
        for _ in range(int(epochs or 0)):
            yield from batch_slices(num_examples, batch_size, generator, device)
        return
    done = 0
    while done < steps:
        for idx in batch_slices(num_examples, batch_size, generator, device):
            yield idx
            done += 1
            if done == steps:
                return


def crop_flip(x: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """Random crop after zero padding (``padding`` pixels) and random horizontal flip, per
    image, on the tensor's device; the randomness comes from ``generator``."""
    n, c, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    dy = torch.randint(0, 2 * padding + 1, (n, 1), generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (n, 1), generator=generator)
    flip = torch.rand(n, 1, generator=generator) < 0.5
    rows = dy + torch.arange(h)
    cols = dx + torch.arange(w)
    cols = torch.where(flip, cols.flip(1), cols)
    dev = x.device
    out = padded[torch.arange(n, device=dev)[:, None, None, None], torch.arange(c, device=dev)[None, :, None, None],
                 rows.to(dev)[:, None, :, None], cols.to(dev)[:, None, None, :]]
    if x.is_contiguous(memory_format=torch.channels_last):
        return out.contiguous(memory_format=torch.channels_last)  # keep the layout the model expects
    return out


AUGMENTATIONS = {"crop_flip": crop_flip}


def training_batches(data: TensorData, batch_size: int, generator: torch.Generator, epochs: int | None,
                     steps: int | None, augment: str | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The (inputs, targets) mini-batches of a local training call: :func:`step_batches` of ``data``,
    each augmented on the device when ``augment`` names an augmentation (drawn from ``generator``)."""
    transform = AUGMENTATIONS[augment] if augment else None
    for idx in step_batches(len(data), batch_size, generator, data.y.device, epochs, steps):
        xb = data.x[idx]
        yield (transform(xb, generator) if transform is not None else xb), data.y[idx]

#: Where FedProx's pull mu·(w − w_start) enters a local step (:func:`train`'s ``prox_pull``).
PROX_PULLS = ("gradient", "after_momentum")


def train(
    model: nn.Module,
    data: TensorData,
    optimizer: OptimizerConfig,
    batch_size: int,
    generator: torch.Generator,
    epochs: int | None = 1,
    steps: int | None = None,
    params: Sequence[nn.Parameter] | None = None,
    prox_mu: float = 0.0,
    prox_pull: str = "gradient",
    prox_anchor: Sequence[torch.Tensor] | None = None,
    regression: bool = False,
    augment: str | None = None,
    grad_correction: Sequence[torch.Tensor] | None = None,
) -> TrainResult:
    """Train ``model`` in place with mini-batch SGD.

    Runs ``epochs`` passes over ``data`` or, when ``steps`` is given, exactly ``steps``
    mini-batch steps. Only ``params`` are updated (default: all parameters). With
    ``prox_mu > 0`` the FedProx term (mu/2)·||w − w_start||² over the trained parameters
    pulls toward the start; ``prox_pull`` (:data:`PROX_PULLS`) says where its pull
    mu·(w − w_start) enters (``prox_anchor``, one tensor per trained parameter, replaces w_start:
    Ditto's personal model is pulled toward the received global model): ``gradient`` adds it to the loss's gradient, so momentum carries it
    (FedProx's objective), ``after_momentum`` adds it to the step after the optimizer's
    momentum, w ← w − lr·(momentum step + mu·(w − w_start)) (the FedProx optimizer of the
    official FedRep code, ``FedProx.py``). ``augment`` names an on-device augmentation of each batch
    (``crop_flip``), drawn from ``generator``. ``grad_correction`` (one tensor per trained
    parameter) is added to every mini-batch gradient before the step (SCAFFOLD's c − c_i).
    """
    trainable = list(params) if params is not None else list(model.parameters())
    opt = optimizer.build(trainable, model)
    if prox_pull not in PROX_PULLS:
        raise ValueError(f"prox_pull: {prox_pull!r} is not one of {PROX_PULLS}")
    if prox_mu <= 0:
        anchors = None
    elif prox_anchor is not None:
        anchors = [a.detach().to(p.device) for p, a in zip(trainable, prox_anchor, strict=True)]
    else:
        anchors = [p.detach().clone() for p in trainable]
    pull_in_gradient = anchors is not None and prox_pull == "gradient"
    pull_after_step = anchors is not None and prox_pull == "after_momentum"
    loss_fn = loss_function(regression)
    model.train()
    total = torch.zeros((), device=data.y.device)
    num_steps, samples = 0, 0
    if len(data) == 0:
        return TrainResult(0.0, 0, 0)
    for xb, yb in training_batches(data, batch_size, generator, epochs, steps, augment):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xb), yb)
        loss.backward()
        if pull_in_gradient:
            with torch.no_grad():
                for p, anchor in zip(trainable, anchors):
                    if p.grad is not None:
                        p.grad.add_(p - anchor, alpha=prox_mu)
        if grad_correction is not None:
            with torch.no_grad():
                for p, corr in zip(trainable, grad_correction):
                    if p.grad is not None:
                        p.grad.add_(corr)
        if pull_after_step:
            with torch.no_grad():
                pulls = [torch.sub(p, anchor) if p.grad is not None else None for p, anchor in zip(trainable, anchors)]
        opt.step()
        if pull_after_step:
            with torch.no_grad():
                for p, pull in zip(trainable, pulls):
                    if pull is not None:
                        p.sub_(pull, alpha=optimizer.lr * prox_mu)
        total += loss.detach() * len(yb)
        samples += len(yb)
        num_steps += 1
    return TrainResult(float(total) / max(samples, 1), num_steps, samples)


def derived_seed(*parts: int) -> int:
    """A 32-bit seed that is a deterministic function of integer ``parts``."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


def seed_global_generators(seed: int, device: torch.device) -> None:
    """Seed the global generators that work on ``device`` draws from (dropout): on a CPU the CPU's
    alone, elsewhere every one of torch's (``torch.manual_seed``; on a CPU run it would also queue a
    seed for CUDA, at the cost of a stack trace per call)."""
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def seeded_generator(*parts: int) -> torch.Generator:
    """A CPU generator whose seed is a deterministic function of integer ``parts``."""
    return torch.Generator().manual_seed(derived_seed(*parts))
