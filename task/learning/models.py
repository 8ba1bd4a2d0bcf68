"""Every model of the project, built as a :class:`task.learning.split_model.SplitModel`: a sequence
of named layer groups, so algorithms choose the body and the head by group name.

Models output logits by default (``model.output=logits``): the official CNNs end in
``log_softmax``, which cross-entropy makes a no-op. The official MLPs of LG-FedAvg (MNIST) and
FedRep (FEMNIST) end in ``softmax`` and still feed cross-entropy, i.e. softmax twice;
``model.output=softmax`` reproduces that (:class:`task.learning.split_model.SoftmaxLinear` as the
output layer).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from task.errors import ConfigError
from task.learning.split_model import SplitModel, softmax_output

#: GroupNorm groups in ``resnet18_gn``. Unconfirmed for TCT (its public code has no ResNet);
#: 2 groups is the usual choice in federated learning (Hsieh et al., 2020). The parameter
#: count does not depend on it.
RESNET_GN_GROUPS = 2

#: Default representation dimension k of ``linear_rep`` (FedRep's synthetic setting, d=20, k=2).
LINEAR_REP_DIM = 2

#: ``model.output``: what the network's forward returns.
OUTPUTS = ("logits", "softmax")

#: Models whose outputs are not class scores of a plain forward pass (regression, or FairMLP whose
#: ``classify`` feeds its own softmax): ``model.output=softmax`` is refused for them.
_LOGITS_ONLY = ("quadratic", "linear_rep", "adult_fair")


class BatchNorm1d(nn.BatchNorm1d):
    """Batch normalisation over features that, in training, normalises a batch of one sample by
    the running statistics (without updating them) instead of failing: a client's last mini-batch
    can hold a single sample."""

    def forward(self, x: Tensor) -> Tensor:
        """Batch statistics, or the running ones for a single training sample."""
        if self.training and x.shape[0] == 1:
            return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                            False, 0.0, self.eps)
        return super().forward(x)


def _image_shape(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ConfigError(f"model.name: {name} needs a (C, H, W) input shape, got {input_shape}")
    return input_shape  # type: ignore[return-value]


def _flat_size(name: str, convs: Sequence[nn.Module], input_shape: tuple[int, ...]) -> int:
    """Number of features after ``convs`` on one input of ``input_shape`` (a dry run)."""
    x = torch.zeros(1, *input_shape)
    try:
        with torch.no_grad():
            for conv in convs:
                x = conv(x)
    except RuntimeError as err:
        raise ConfigError(f"model.name: input shape {input_shape} is too small for {name}") from err
    return x.numel()


def _add_fc_groups(
    groups: OrderedDict[str, nn.Module],
    n_in: int,
    hidden: Sequence[int],
    num_classes: int,
    dropout_last_hidden: float = 0.0,
    batch_norm: bool = False,
) -> SplitModel:
    """Append ReLU linear groups ``fc1..`` (fc1 flattens first; with ``batch_norm`` a
    :class:`BatchNorm1d` before each ReLU) and a linear head; build."""
    sizes = (n_in, *hidden)
    for i, (n, m) in enumerate(zip(sizes, hidden), start=1):
        layers: list[nn.Module] = [nn.Flatten()] if i == 1 else []
        layers += [nn.Linear(n, m), *([BatchNorm1d(m)] if batch_norm else []), nn.ReLU()]
        if i == len(hidden) and dropout_last_hidden:
            layers.append(nn.Dropout(dropout_last_hidden))
        groups[f"fc{i}"] = nn.Sequential(*layers)
    groups[f"fc{len(hidden) + 1}"] = nn.Linear(sizes[-1], num_classes)
    return SplitModel(groups)


def _conv_fc_net(
    name: str,
    input_shape: tuple[int, ...],
    channels: Sequence[int],
    hidden: Sequence[int],
    num_classes: int,
    dropout_last_hidden: float = 0.0,
    batch_norm: bool = False,
) -> SplitModel:
    """Groups ``conv1..`` (5x5 conv, ReLU, 2x2 max pool; with ``batch_norm`` a BatchNorm2d after
    each conv and a :class:`BatchNorm1d` after each hidden linear layer, as FedBN's CNNs), then
    ``fc1..`` and a linear head."""
    c, _, _ = _image_shape(name, input_shape)
    groups: OrderedDict[str, nn.Module] = OrderedDict()
    for i, (c_in, c_out) in enumerate(zip((c, *channels), channels), start=1):
        norm = [nn.BatchNorm2d(c_out)] if batch_norm else []
        groups[f"conv{i}"] = nn.Sequential(nn.Conv2d(c_in, c_out, 5), *norm, nn.ReLU(), nn.MaxPool2d(2))
    n_in = _flat_size(name, [g.eval() for g in groups.values()], input_shape)  # eval: moves no BN statistics
    for g in groups.values():
        g.train()
    return _add_fc_groups(groups, n_in, hidden, num_classes, dropout_last_hidden, batch_norm)


def _mlp(input_shape: tuple[int, ...], hidden: Sequence[int], num_classes: int) -> SplitModel:
    """Groups ``fc1..`` (ReLU linear layers on the flattened input) and a linear head."""
    return _add_fc_groups(OrderedDict(), math.prod(input_shape), hidden, num_classes)


def fedrep_cnn(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """FedRep's CIFAR-10 CNN (lgcollins/FedRep ``models/Nets.py``, ``CNNCifar``; confirmed).

    conv 5x5 3->64, conv 5x5 64->64 (each ReLU + maxpool 2), fc 1600-120-64-classes.
    307,842 parameters on (3, 32, 32) with 10 classes. Groups conv1, conv2, fc1, fc2, fc3.
    """
    return _conv_fc_net("fedrep_cnn", input_shape, (64, 64), (120, 64), num_classes)


def fedrep_cnn_bn(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """``fedrep_cnn`` with batch normalisation after every conv and hidden linear layer (before
    its ReLU), the layers FedBN keeps local. Same groups as ``fedrep_cnn``."""
    return _conv_fc_net("fedrep_cnn_bn", input_shape, (64, 64), (120, 64), num_classes, batch_norm=True)


def fedrep_cnn100(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """FedRep's CIFAR-100 CNN (``CNNCifar100`` in the same file; confirmed).

    Wider than ``fedrep_cnn``: conv 3->64, conv 64->128, fc 3200-256-128-classes, with
    Dropout(0.6) after fc2's ReLU. 1,075,044 parameters on (3, 32, 32) with 100 classes.
    """
    return _conv_fc_net(
        "fedrep_cnn100", input_shape, (64, 128), (256, 128), num_classes, dropout_last_hidden=0.6
    )


def fedavgft_cnn(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """The CNN of "FedAvg with fine tuning" (Collins et al. 2022, Section 5.2): three blocks of
    two convolutions and a max pool, then a three-layer MLP. The paper gives no widths (its
    Appendix C is not in our copy); ours, VGG-like: 3x3 convs with padding 1 and ReLU, widths
    32-32, 64-64, 128-128 (each block then maxpool 2), fc 2048-256-128-classes with ReLU.
    Groups block1, block2, block3, fc1, fc2, fc3; 845,738 parameters on (3, 32, 32) with 10 classes.
    The layers followed by a ReLU are He-initialised (Kaiming normal, zero biases): with
    PyTorch's default initialisation this nine-layer ReLU net without normalisation stayed at
    chance (loss ln 10) for 400 SGD steps at lr 0.05 on CIFAR-10. The output layer keeps
    PyTorch's default (about 0.4 of He's scale): He-initialised too, its initial logits gave
    losses up to 6.3 and a D-SGD run on Fashion-MNIST diverged at lr 0.05 (measured; docs/models.md).
    """
    c, _, _ = _image_shape("fedavgft_cnn", input_shape)
    groups: OrderedDict[str, nn.Module] = OrderedDict()
    for i, (c_in, c_out) in enumerate(zip((c, 32, 64), (32, 64, 128)), start=1):
        groups[f"block{i}"] = nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(),
                                            nn.Conv2d(c_out, c_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    n_in = _flat_size("fedavgft_cnn", list(groups.values()), input_shape)
    model = _add_fc_groups(groups, n_in, (256, 128), num_classes)
    layers = [layer for layer in model.modules() if isinstance(layer, (nn.Conv2d, nn.Linear))]
    for layer in layers[:-1]:  # the output layer has no ReLU after it: PyTorch's default
        nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
        nn.init.zeros_(layer.bias)
    return model


def lenet5(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """LG-FedAvg's LeNet-5 for CIFAR (LG-FedAvg ``models/Nets.py``, ``CNNCifar``; confirmed).

    conv 3->6, conv 6->16 (5x5, ReLU, maxpool 2), fc 400-120-100-classes (ReLU).
    64,102 parameters on (3, 32, 32) with 10 classes; conv1 + conv2 hold 2,872.
    """
    return _conv_fc_net("lenet5", input_shape, (6, 16), (120, 100), num_classes)


def simple_cnn(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """TCT's SimpleCNN for Fashion-MNIST, as the TCT paper describes it.

    The paper (Sec. 5.1): two convolutional layers with max pooling, then two fully connected
    layers, ReLU. Widths are unconfirmed: yaodongyu/TCT only ships an MNIST example with a
    different net (three stride-2 convs). Used here: McMahan et al.'s FedAvg CNN, conv 5x5
    1->32, conv 5x5 32->64 (each ReLU + maxpool 2), fc 1024-512-classes. 582,026 parameters on
    (1, 28, 28) with 10 classes, 577,409 with a single output logit (the design doc's "577K").
    """
    return _conv_fc_net("simple_cnn", input_shape, (32, 64), (512,), num_classes)


def mlp_mnist(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """LG-FedAvg's MNIST MLP (``MLP`` in pliang279/LG-FedAvg ``models/Nets.py``; confirmed).

    784-512-256-256-128-classes with ReLU. The official class defines a Dropout but never
    applies it, so there is none here. 633,226 parameters with 10 classes; fc3..fc5 hold 99,978.
    """
    return _mlp(input_shape, (512, 256, 256, 128), num_classes)


def mlp_femnist(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """FedRep's FEMNIST MLP (``MLP`` in lgcollins/FedRep ``models/Nets.py``; confirmed).

    ``--dataset femnist --model mlp`` builds ``MLP(dim_in=784, ..., dim_out=num_classes)``:
    784-512-256-64-classes with ReLU (its ``Dropout(0)`` is never applied). 550,346
    parameters with 10 classes. FedRep's head for it is the last layer (fc4).
    """
    return _mlp(input_shape, (512, 256, 64), num_classes)


def digits_mlp(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """Small MLP for scikit-learn's 8x8 digits: 64-64-classes, ReLU; 4,810 params (10 classes)."""
    return _mlp(input_shape, (64,), num_classes)


def digits_mlp_bn(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """``digits_mlp`` with a :class:`BatchNorm1d` before its ReLU (FedBN on the quickstart)."""
    return _add_fc_groups(OrderedDict(), math.prod(input_shape), (64,), num_classes, batch_norm=True)


def linear(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """One linear layer on the flattened input (group ``fc1``): least squares on regression
    data, multinomial logistic regression on classes. A convex problem (SCAFFOLD's bias test)."""
    return SplitModel(OrderedDict(fc1=nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))))


def quadratic(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """x ∈ R^d as one bias-free linear map (group ``fc1``): with ``synthetic_quadratic`` data
    its regression loss is the LocalUpdate analysis' quadratic f_i(x)."""
    return SplitModel(OrderedDict(fc1=nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes, bias=False))))


def resnet18_gn(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """ResNet-18 with GroupNorm for 32x32 images (TCT's "ResNet18-GN").

    CIFAR variant: 3x3 stride-1 stem without max pooling, four stages of two torchvision
    ``BasicBlock`` (64, 128, 256, 512 channels), global average pooling, linear head.
    GroupNorm with :data:`RESNET_GN_GROUPS` groups replaces BatchNorm (no running buffers, so
    per-sample gradients are independent). Unconfirmed against TCT's code, which is not public.
    11,173,962 parameters on (3, 32, 32) with 10 classes. Groups stem, layer1..layer4, pool, fc.
    """
    from torchvision.models.resnet import BasicBlock, conv1x1  # torchvision's import costs ~1.5 s: only here

    c, _, _ = _image_shape("resnet18_gn", input_shape)

    def norm(channels: int) -> nn.GroupNorm:
        return nn.GroupNorm(RESNET_GN_GROUPS, channels)

    def stage(c_in: int, c_out: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or c_in != c_out:
            downsample = nn.Sequential(conv1x1(c_in, c_out, stride), norm(c_out))
        return nn.Sequential(
            BasicBlock(c_in, c_out, stride, downsample, norm_layer=norm),
            BasicBlock(c_out, c_out, norm_layer=norm),
        )

    groups: OrderedDict[str, nn.Module] = OrderedDict(
        stem=nn.Sequential(nn.Conv2d(c, 64, 3, padding=1, bias=False), norm(64), nn.ReLU()),
        layer1=stage(64, 64, 1),
        layer2=stage(64, 128, 2),
        layer3=stage(128, 256, 2),
        layer4=stage(256, 512, 2),
        pool=nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()),
        fc=nn.Linear(512, num_classes),
    )
    return SplitModel(groups)


def linear_rep(
    input_shape: tuple[int, ...], num_classes: int, rep_dim: int = LINEAR_REP_DIM
) -> SplitModel:
    """FedRep's multi-task linear representation: body Linear(d->k), head Linear(k->out).

    No biases; ``num_classes`` is the output dimension (1 for regression), ``rep_dim`` is k.
    """
    if len(input_shape) != 1:
        raise ConfigError(f"model.name: linear_rep needs a (d,) input shape, got {input_shape}")
    if rep_dim < 1:
        raise ConfigError(f"model.rep_dim: must be a positive integer, got {rep_dim}")
    return SplitModel(
        OrderedDict(
            body=nn.Linear(input_shape[0], rep_dim, bias=False),
            head=nn.Linear(rep_dim, num_classes, bias=False),
        )
    )


class FairMLP(SplitModel):
    """LG-FedAvg's UCI Adult networks (Section 5.3, Table 8; layouts from the official ``main_fair.py``).

    Representation ``fc1..fc3``: input-32-32-32 with ReLU and dropout 0.2 between layers
    (``h`` is the third layer's linear output, the official code's ``mid``). Classifier
    ``g1..g3`` on ``h``: 32-32-classes with ReLU and dropout 0.2 (the official global
    classifier; two logits and cross-entropy stand for its single sigmoid output).
    ``adversary`` (not a layer group, not on the forward path): 32-32-32-32-attributes with
    ReLU, one logit per binary protected attribute, reading ``h``.
    """

    branches = ("adversary",)
    #: The classifier groups (the LG-FedAvg global part); everything before them is ``h``.
    classifier_groups = ("g1", "g2", "g3")

    def __init__(self, n_in: int, num_classes: int, num_attributes: int = 2, hidden: int = 32,
                 dropout: float = 0.2) -> None:
        def block(n: int, relu_after: bool) -> nn.Sequential:
            layers: list[nn.Module] = [nn.Linear(n, hidden)]
            return nn.Sequential(*layers, nn.ReLU(), nn.Dropout(dropout)) if relu_after else nn.Sequential(*layers)

        groups = OrderedDict(fc1=block(n_in, True), fc2=block(hidden, True), fc3=block(hidden, False),
                             g1=nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout)),
                             g2=nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout)),
                             g3=nn.Linear(hidden, num_classes))
        super().__init__(groups)
        adv: list[nn.Module] = []
        for _ in range(3):
            adv += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.adversary = nn.Sequential(*adv, nn.Linear(hidden, num_attributes))

    def representation(self, x: Tensor) -> Tensor:
        """The local representation ``h`` (output of ``fc3``)."""
        return self.features(x, self.classifier_groups)

    def classify(self, h: Tensor) -> Tensor:
        """Class logits from the representation."""
        return self.head_forward(h, self.classifier_groups)


def adult_fair(input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
    """:class:`FairMLP` for tabular inputs (93 features with ``data.adult_split=fairness``)."""
    if len(input_shape) != 1:
        raise ConfigError(f"model.name: adult_fair needs tabular (D,) inputs, got {input_shape}")
    return FairMLP(input_shape[0], num_classes)


_BUILDERS: dict[str, Callable[[tuple[int, ...], int], SplitModel]] = {
    "adult_fair": adult_fair,
    "fedrep_cnn": fedrep_cnn,
    "fedrep_cnn_bn": fedrep_cnn_bn,
    "fedrep_cnn100": fedrep_cnn100,
    "fedavgft_cnn": fedavgft_cnn,
    "mlp_mnist": mlp_mnist,
    "lenet5": lenet5,
    "mlp_femnist": mlp_femnist,
    "simple_cnn": simple_cnn,
    "resnet18_gn": resnet18_gn,
    "digits_mlp": digits_mlp,
    "digits_mlp_bn": digits_mlp_bn,
    "linear": linear,
    "quadratic": quadratic,
    "linear_rep": linear_rep,
}

MODEL_NAMES: tuple[str, ...] = tuple(_BUILDERS)


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    rep_dim: int = LINEAR_REP_DIM,
    output: str = "logits",
) -> SplitModel:
    """Build model ``name`` for inputs of ``input_shape`` ((C, H, W) or (D,)).

    ``rep_dim`` (the representation dimension k) is used by ``linear_rep`` only. ``output``
    (``model.output``, one of :data:`OUTPUTS`): ``softmax`` makes forward return class
    probabilities, which the unchanged cross-entropy then treats as logits (the official MLPs).
    """
    if name not in _BUILDERS:
        raise ConfigError(f"model.name: unknown model {name!r}; allowed: {list(MODEL_NAMES)}")
    if output not in OUTPUTS:
        raise ConfigError(f"model.output: unknown value {output!r}; allowed: {list(OUTPUTS)}")
    if output == "softmax" and (name in _LOGITS_ONLY or num_classes < 2):
        raise ConfigError(
            f"model.output: 'softmax' needs a classifier with at least 2 classes; model.name={name!r} with "
            f"{num_classes} output(s) is not one (use logits)"
        )
    input_shape = tuple(input_shape)
    if name == "linear_rep":
        return linear_rep(input_shape, num_classes, rep_dim)
    model = _BUILDERS[name](input_shape, num_classes)
    return softmax_output(model) if output == "softmax" else model
