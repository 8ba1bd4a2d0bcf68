"""Tests for task.learning.models: architectures, parameter counts and body/head splitting."""

from collections import OrderedDict

import pytest
import torch
from torch import nn

from task.errors import ConfigError
from task.learning.models import MODEL_NAMES, build_model
from task.learning.split_model import SplitModel

# name -> (natural input shape, classes, total parameters, groups)
MODELS = {
    "fedrep_cnn": ((3, 32, 32), 10, 307_842, ["conv1", "conv2", "fc1", "fc2", "fc3"]),
    "fedrep_cnn_bn": ((3, 32, 32), 10, 307_842 + 4 * (64 + 64 + 120 + 64) + 4,  # BN: weight, bias, running mean, var; 4 counters
                      ["conv1", "conv2", "fc1", "fc2", "fc3"]),
    "fedavgft_cnn": ((3, 32, 32), 10, 845_738, ["block1", "block2", "block3", "fc1", "fc2", "fc3"]),
    "fedrep_cnn100": ((3, 32, 32), 100, 1_075_044, ["conv1", "conv2", "fc1", "fc2", "fc3"]),
    "mlp_mnist": ((1, 28, 28), 10, 633_226, ["fc1", "fc2", "fc3", "fc4", "fc5"]),
    "lenet5": ((3, 32, 32), 10, 64_102, ["conv1", "conv2", "fc1", "fc2", "fc3"]),
    "mlp_femnist": ((1, 28, 28), 10, 550_346, ["fc1", "fc2", "fc3", "fc4"]),
    "simple_cnn": ((1, 28, 28), 10, 582_026, ["conv1", "conv2", "fc1", "fc2"]),
    "resnet18_gn": (
        (3, 32, 32),
        10,
        11_173_962,
        ["stem", "layer1", "layer2", "layer3", "layer4", "pool", "fc"],
    ),
    "digits_mlp": ((64,), 10, 4_810, ["fc1", "fc2"]),
    "digits_mlp_bn": ((64,), 10, 4_810 + 4 * 64 + 1, ["fc1", "fc2"]),
    "linear_rep": ((20,), 1, 20 * 2 + 2 * 1, ["body", "head"]),
    "linear": ((5,), 1, 5 + 1, ["fc1"]),
    "quadratic": ((4,), 1, 4, ["fc1"]),
    # classifier 93-32-32-32-32-32-2 (7,298) + adversary 32-32-32-32-2 (3,234)
    "adult_fair": ((93,), 2, 10_532, ["fc1", "fc2", "fc3", "g1", "g2", "g3"]),
}


def n_params(model: nn.Module, names: list[str] | None = None) -> int:
    state = model.state_dict()
    return sum(state[k].numel() for k in (names if names is not None else state))


def build(name: str, shape: tuple[int, ...] | None = None, classes: int | None = None):
    torch.manual_seed(0)
    natural_shape, natural_classes, _, _ = MODELS[name]
    model = build_model(name, shape or natural_shape, classes or natural_classes)
    return model.eval()


def test_model_names_cover_all_models():
    assert set(MODEL_NAMES) == set(MODELS)


@pytest.mark.parametrize("name", list(MODELS))
def test_parameter_count_groups_and_default_head(name):
    _, _, count, groups = MODELS[name]
    model = build(name)
    assert isinstance(model, SplitModel)
    assert n_params(model) == count  # the state: parameters and buffers (batch norm's statistics)
    assert sum(p.numel() for p in model.parameters()) == count - sum(b.numel() for b in model.buffers())
    assert model.group_names == groups
    assert model.default_head == (groups[-1],)
    assert all(k.split(".", 1)[0] in groups + list(model.branches) for k in model.state_dict())


def test_documented_partial_counts():
    assert n_params(build("lenet5"), build("lenet5").parameter_names(["conv1", "conv2"])) == 2_872
    mlp = build("mlp_mnist")
    assert n_params(mlp, mlp.parameter_names(["fc3", "fc4", "fc5"])) == 99_978
    # TCT's eNTK uses one logit: SimpleCNN with one output has the design doc's ~577K.
    assert n_params(build("simple_cnn", classes=1)) == 577_409
    assert n_params(build("resnet18_gn", classes=100)) == 11_220_132


def test_official_layer_names_and_shapes():
    cnn = build("fedrep_cnn")
    assert cnn.fc1[1].in_features == 1600 and cnn.fc3.in_features == 64
    cnn100 = build("fedrep_cnn100")
    assert [m.p for m in cnn100.modules() if isinstance(m, nn.Dropout)] == [0.6]
    assert isinstance(cnn100.fc2[-1], nn.Dropout)
    lenet = build("lenet5")
    assert lenet.fc1[1].in_features == 400
    assert not any(isinstance(m, nn.Dropout) for m in build("mlp_mnist").modules())
    resnet = build("resnet18_gn")
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in resnet.modules())
    assert not list(resnet.buffers())
    rep = build("linear_rep")
    assert rep.body.bias is None and rep.head.bias is None
    assert rep.body.weight.shape == (2, 20)


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_shape(name):
    shape, classes, _, _ = MODELS[name]
    assert build(name)(torch.randn(3, *shape)).shape == (3, classes)


@pytest.mark.parametrize(
    ("name", "shape", "classes"),
    [
        ("fedrep_cnn", (1, 28, 28), 10),
        ("lenet5", (1, 28, 28), 62),
        ("simple_cnn", (3, 32, 32), 10),
        ("resnet18_gn", (1, 28, 28), 10),
        ("mlp_mnist", (784,), 10),
        ("mlp_femnist", (784,), 62),
        ("digits_mlp", (1, 8, 8), 10),
    ],
)
def test_other_input_shapes(name, shape, classes):
    model = build(name, shape, classes)
    assert model(torch.randn(2, *shape)).shape == (2, classes)


def test_fair_mlp_adversary_reads_the_representation_off_the_forward_path():
    model = build("adult_fair")
    x = torch.randn(5, 93)
    with torch.no_grad():
        h = model.representation(x)
        assert h.shape == (5, 32) and model.adversary(h).shape == (5, 2)
        torch.testing.assert_close(model.classify(h), model(x))
    assert "adversary" not in model.group_names
    assert model.parameter_names(["g1", "g2", "g3"]) == ["g1.0.weight", "g1.0.bias", "g2.0.weight", "g2.0.bias",
                                                         "g3.weight", "g3.bias"]


def test_linear_rep_dimension():
    model = build_model("linear_rep", (20,), 1, rep_dim=5)
    assert model.body.weight.shape == (5, 20) and model.head.weight.shape == (1, 5)


@pytest.mark.parametrize("name", list(MODELS))
def test_split_matches_full_forward_for_every_suffix(name):
    shape, _, _, groups = MODELS[name]
    model = build(name)
    x = torch.randn(2, *shape)
    with torch.no_grad():
        full = model(x)
        for i in range(len(groups)):
            head = groups[i:]
            assert model.split_at(head) == i
            z = model.features(x, head)
            torch.testing.assert_close(model.head_forward(z, head), full)


def test_features_of_default_head_are_flat():
    model = build("fedrep_cnn")
    assert model.features(torch.randn(2, 3, 32, 32), model.default_head).shape == (2, 64)
    resnet = build("resnet18_gn")
    assert resnet.features(torch.randn(2, 3, 32, 32), ["fc"]).shape == (2, 512)


def test_parameter_names_in_state_dict_order():
    model = build("lenet5")
    assert model.parameter_names(["fc3", "conv1"]) == [
        "conv1.0.weight",
        "conv1.0.bias",
        "fc3.weight",
        "fc3.bias",
    ]
    assert model.parameter_names("fc3") == ["fc3.weight", "fc3.bias"]
    assert model.parameter_names([]) == []
    resnet = build("resnet18_gn")
    keys = list(resnet.state_dict())
    body = resnet.parameter_names(resnet.group_names[:-1])
    assert body + resnet.parameter_names(["fc"]) == keys


def test_parameter_names_include_buffers():
    model = SplitModel(OrderedDict(a=nn.BatchNorm1d(3), b=nn.Linear(3, 2)))
    assert model.parameter_names(["a"]) == [
        "a.weight",
        "a.bias",
        "a.running_mean",
        "a.running_var",
        "a.num_batches_tracked",
    ]


def test_unknown_model_name():
    with pytest.raises(ConfigError, match="model.name") as err:
        build_model("vgg", (3, 32, 32), 10)
    assert all(name in str(err.value) for name in MODEL_NAMES)


def test_wrong_input_rank():
    with pytest.raises(ConfigError, match="model.name"):
        build_model("fedrep_cnn", (784,), 10)
    with pytest.raises(ConfigError, match="model.name"):
        build_model("linear_rep", (1, 8, 8), 1)
    with pytest.raises(ConfigError, match="too small"):
        build_model("lenet5", (3, 8, 8), 10)


def test_unknown_groups():
    model = build("lenet5")
    with pytest.raises(ConfigError, match="model.local_layers") as err:
        model.check_groups(["conv1", "fc9"], "model.local_layers")
    assert "fc9" in str(err.value) and "conv2" in str(err.value)
    with pytest.raises(ConfigError, match="fc9"):
        model.parameter_names(["fc9"])
    with pytest.raises(ConfigError, match="model.head"):
        model.split_at(["fc9"])
    model.check_groups(["fc1", "conv2"], "model.local_layers")


@pytest.mark.parametrize("head", [[], ["fc2"], ["fc3", "fc2"], ["fc1", "fc3"], ["conv1"]])
def test_non_suffix_head(head):
    model = build("lenet5")
    with pytest.raises(ConfigError, match="my.head") as err:
        model.split_at(head, key="my.head")
    assert "suffix" in str(err.value)
    with pytest.raises(ConfigError, match="model.head"):
        model.features(torch.randn(1, 3, 32, 32), head)


def test_slicing_keeps_a_split_model():
    model = build("lenet5")
    body = model[:2]
    assert isinstance(body, SplitModel) and body.group_names == ["conv1", "conv2"]


@pytest.mark.parametrize("name", ["mlp_mnist", "mlp_femnist", "fedrep_cnn", "resnet18_gn", "digits_mlp"])
def test_softmax_output_is_the_official_double_softmax(name):
    shape, classes, count, groups = MODELS[name]
    torch.manual_seed(0)
    probs_model = build_model(name, shape, classes, output="softmax").eval()
    logits_model = build(name)
    # the same parameters, keys and initial weights: only the output differs
    assert probs_model.state_dict().keys() == logits_model.state_dict().keys() and n_params(probs_model) == count
    for key, value in logits_model.state_dict().items():
        torch.testing.assert_close(probs_model.state_dict()[key], value)
    assert probs_model.group_names == groups and probs_model.default_head == (groups[-1],)
    x, y = torch.randn(6, *shape), torch.randint(0, classes, (6,))
    with torch.no_grad():
        probs, logits = probs_model(x), logits_model(x)
        torch.testing.assert_close(probs.sum(dim=1), torch.ones(6))
        torch.testing.assert_close(probs, torch.softmax(logits, dim=1))
        assert torch.equal(probs.argmax(dim=1), logits.argmax(dim=1))
        # the unchanged loss treats the probabilities as logits: cross-entropy of softmax(logits)
        torch.testing.assert_close(nn.functional.cross_entropy(probs, y),
                                   nn.functional.cross_entropy(torch.softmax(logits, dim=1), y))
        z = probs_model.features(x, probs_model.default_head)  # FedRep's head on cached features
        torch.testing.assert_close(probs_model.head_forward(z, probs_model.default_head), probs)


@pytest.mark.parametrize(("name", "classes"), [("linear_rep", 1), ("quadratic", 1), ("adult_fair", 2), ("linear", 1)])
def test_softmax_output_refused_where_outputs_are_not_class_scores(name, classes):
    shape = MODELS[name][0]
    with pytest.raises(ConfigError, match="model.output") as err:
        build_model(name, shape, classes, output="softmax")
    assert "logits" in str(err.value)
    with pytest.raises(ConfigError, match="model.output.*allowed"):
        build_model("mlp_mnist", (1, 28, 28), 10, output="probs")


def test_softmax_output_of_the_linear_classifier():
    model = build_model("linear", (5,), 3, output="softmax")
    assert list(model.state_dict()) == ["fc1.1.weight", "fc1.1.bias"]
    torch.testing.assert_close(model(torch.randn(4, 5)).sum(dim=1), torch.ones(4))


def test_the_fedavgft_cnn_starts_with_a_signal_that_survives_its_nine_layers():
    """He initialisation: PyTorch's default init leaves this ReLU net without normalisation with
    outputs about 2e-4 apart across inputs, at which SGD stayed at chance for hundreds of steps."""
    torch.manual_seed(0)
    model = build_model("fedavgft_cnn", (3, 32, 32), 10)
    with torch.no_grad():
        spread = model(torch.randn(64, 3, 32, 32)).std(0).mean().item()
    assert spread > 0.1
    *hidden, output = [layer for layer in model.modules() if isinstance(layer, (nn.Conv2d, nn.Linear))]
    model.requires_grad_(False)
    assert all(float(layer.bias.abs().max()) == 0.0 for layer in hidden)
    for layer in hidden[-2:]:  # He: std sqrt(2 / fan_in)
        assert float(layer.weight.std()) == pytest.approx((2 / layer.in_features) ** 0.5, rel=0.1)
    # the output layer (no ReLU after it) keeps PyTorch's default, uniform with std 1 / sqrt(3 fan_in)
    assert float(output.weight.std()) == pytest.approx((3 * output.in_features) ** -0.5, rel=0.15)
