"""eNTK features (task/tct/entk.py, task/tct/entk_hooks.py): every method against the per-sample reference loop."""

import numpy as np
import pytest
import torch
from torch import nn

from task.tct import entk_hooks
from task.tct.entk import (
    METHODS,
    entk_features,
    entk_network,
    extract_features,
    parameter_count,
    select_coordinates,
)
from task.learning.models import build_model


class GroupNormResidual(nn.Module):
    """conv (no bias) -> GroupNorm -> ReLU, plus a residual block, pooling, linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(2, 4)
        self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu_(self.gn1(self.stem(x)))
        out = self.gn2(self.conv(h))
        out += h
        return self.head(torch.relu_(out).mean((2, 3)))


class Reused(nn.Module):
    """A Linear called twice, a Linear tied to it, and a Linear on (N, T, D) inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.tied = nn.Linear(4, 4, bias=False)
        self.tied.weight = self.shared.weight
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(torch.tanh(self.shared(x))))
        return self.head(torch.tanh(self.tied(h)).mean(1))


def tiny_mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def tiny_conv() -> nn.Module:
    """TCT's official MNIST net in miniature: three stride-2 padded convs with bias."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(6, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(32, 5), nn.ReLU(), nn.Linear(5, 2),
    )


def padded_conv() -> nn.Module:
    """Convolutions with 'same' dilated reflect padding, circular padding and a rectangular kernel."""
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding="same", dilation=2, padding_mode="reflect"), nn.Tanh(),
        nn.Conv2d(3, 3, (2, 3), stride=(1, 2), padding=1, padding_mode="circular"), nn.Tanh(),
        nn.Flatten(), nn.LazyLinear(2),
    )


CASES = {
    "mlp": (tiny_mlp, (6,)),
    "conv": (tiny_conv, (1, 12, 12)),
    "groupnorm_residual": (GroupNormResidual, (2, 6, 6)),
    "padded_conv": (padded_conv, (2, 7, 7)),
    "reused": (Reused, (3, 4)),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-6) -> None:
    """Equal up to ``rtol`` times the feature scale (float32 summation order differs)."""
    scale = expected.abs().max().item()
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    assert (actual - expected).abs().max().item() <= rtol * max(scale, 1e-12)


def prepared(build, shape, n: int = 5):
    torch.manual_seed(0)
    model = build()
    x = torch.randn(n, *shape)
    model(x)  # materialises lazy layers
    return entk_network(model, seed=1), x


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("products", ["dense", "pair"])
def test_methods_match_loop_on_tiny_models(case, products, monkeypatch):
    """Both ways of forming weight coordinates in 'hooks', in blocks of one row or pair."""
    monkeypatch.setattr(entk_hooks, "_GATHER_ELEMENTS", 16)
    monkeypatch.setattr(entk_hooks, "_DENSE_ENTRY", 0.0 if products == "dense" else float("inf"))
    monkeypatch.setattr(entk_hooks, "_BLAS_GAIN", float("inf"))
    model, x = prepared(*CASES[case])
    coords = torch.arange(parameter_count(model))
    expected = entk_features(model, x, coords, "loop")
    assert expected.abs().max() > 0
    for method in ("hooks", "vmap"):
        actual = entk_features(model, x, coords, method)
        assert_close(actual, expected)
        assert not actual.requires_grad


@pytest.mark.parametrize(("name", "shape", "n", "p"), [
    ("simple_cnn", (1, 28, 28), 4, 2000),
    ("resnet18_gn", (3, 8, 8), 2, 2000),
])
def test_methods_match_loop_on_project_models(name, shape, n, p):
    """Deep nets accumulate more float32 rounding: 5e-6 of the feature scale."""
    torch.manual_seed(0)
    model = entk_network(build_model(name, shape, 10), seed=0)
    coords = select_coordinates(parameter_count(model), p, seed=3)
    x = torch.randn(n, *shape)
    expected = entk_features(model, x, coords, "loop")
    for method in ("hooks", "vmap"):
        assert_close(entk_features(model, x, coords, method), expected, rtol=5e-6)


def test_loop_matches_hand_computed_gradient():
    """f(x) = w2 . (W1 x): df/dW1 = w2 x^T, df/dw2 = W1 x, flattened W1 first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4, bias=False), nn.Linear(4, 1, bias=False)).eval()
    w1, w2 = model[0].weight.detach(), model[1].weight.detach()[0]
    x = torch.randn(2, 3)
    expected = torch.stack([torch.cat([torch.outer(w2, xi).reshape(-1), w1 @ xi]) for xi in x])
    coords = torch.arange(parameter_count(model))
    assert torch.allclose(entk_features(model, x, coords, "loop"), expected, atol=1e-6)


def test_hooks_leave_no_trace_and_respect_frozen_parameters():
    model, x = prepared(*CASES["groupnorm_residual"])
    model.stem.weight.requires_grad_(False)
    coords = torch.arange(parameter_count(model))
    with torch.no_grad():
        feats = {m: entk_features(model, x, coords, m) for m in METHODS}
    assert_close(feats["hooks"], feats["loop"])
    assert feats["loop"][:, : model.stem.weight.numel()].abs().max() > 0
    assert not model.stem.weight.requires_grad
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks for m in model.modules())


def test_select_coordinates_is_a_pure_function_of_the_seed():
    a = select_coordinates(1000, 100, seed=7)
    assert torch.equal(a, select_coordinates(1000, 100, seed=7))
    assert not torch.equal(a, select_coordinates(1000, 100, seed=8))
    assert a.dtype == torch.int64 and a.device.type == "cpu" and len(a) == 100
    assert torch.all(a[1:] > a[:-1]) and a[0] >= 0 and a[-1] < 1000
    assert len(select_coordinates(5, 5, seed=0).unique()) == 5


@pytest.mark.parametrize("p", [0, 1001])
def test_select_coordinates_rejects_p_out_of_range(p):
    with pytest.raises(ValueError, match="tct.features"):
        select_coordinates(1000, p, seed=0)


def test_entk_network():
    torch.manual_seed(0)
    model = build_model("simple_cnn", (1, 28, 28), 10).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    a, b = entk_network(model, seed=5), entk_network(model, seed=5)
    assert torch.equal(torch.get_rng_state(), rng)
    assert a(torch.randn(2, 1, 28, 28)).shape == (2, 1) and not a.training
    assert parameter_count(a) == 577_409
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(torch.equal(v, before[k]) for k, v in a.state_dict().items() if not k.startswith("fc2."))
    with torch.random.fork_rng(devices=[]):  # PyTorch's default init, drawn from the seed
        torch.manual_seed(5)
        reference = nn.Linear(512, 1)
    assert torch.equal(a.fc2.weight, reference.weight) and torch.equal(a.fc2.bias, reference.bias)
    assert not torch.equal(entk_network(model, seed=6).fc2.weight, a.fc2.weight)


def test_extract_features_into_float16_and_memmap(tmp_path):
    model, x = prepared(*CASES["conv"], n=7)
    coords = select_coordinates(parameter_count(model), 50, seed=0)
    expected = entk_features(model, x, coords).half()
    out = torch.zeros(7, 50, dtype=torch.float16)
    extract_features(model, x, coords, out, batch_size=3)
    assert torch.equal(out, expected)
    mm = np.memmap(tmp_path / "feats.f16", dtype=np.float16, mode="w+", shape=(7, 50))
    extract_features(model, x, coords, torch.from_numpy(mm), method="vmap", batch_size=2)
    mm.flush()
    stored = np.memmap(tmp_path / "feats.f16", dtype=np.float16, mode="r", shape=(7, 50))
    assert np.allclose(stored, expected.numpy(), atol=1e-3)


@pytest.mark.parametrize(("model", "x", "module"), [
    (nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 1)), torch.randint(0, 10, (2, 3)), "Embedding"),
    (nn.Sequential(nn.Linear(3, 4), nn.PReLU(), nn.Linear(4, 1)), torch.randn(2, 3), "PReLU"),
    (nn.Sequential(nn.Conv2d(2, 2, 1, groups=2), nn.Flatten(), nn.Linear(8, 1)), torch.randn(2, 2, 2, 2), "Conv2d"),
])
def test_hooks_reject_unsupported_modules(model, x, module):
    coords = torch.arange(parameter_count(model.eval()))
    with pytest.raises(ValueError, match=f"'.*' \\({module}\\).*loop"):
        entk_features(model, x, coords, "hooks")
    assert entk_features(model, x, coords, "loop").shape == (2, len(coords))


def test_hooks_allow_unsupported_modules_without_selected_coordinates():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.PReLU(), nn.Linear(4, 1)).eval()
    coords = torch.tensor([0, 5, 15, 17, 20])  # skips the PReLU weight (index 16)
    x = torch.randn(3, 3)
    assert_close(entk_features(model, x, coords, "hooks"), entk_features(model, x, coords, "loop"))


@pytest.mark.parametrize("layer", [nn.BatchNorm1d(4), nn.Dropout(0.5)])
def test_training_mode_is_rejected(layer):
    model = nn.Sequential(nn.Linear(3, 4), layer, nn.Linear(4, 1)).train()
    for method in METHODS:
        with pytest.raises(ValueError, match="training mode"):
            entk_features(model, torch.randn(2, 3), torch.arange(5), method)


def test_unknown_method_is_rejected():
    model = nn.Linear(3, 1)
    with pytest.raises(ValueError, match="tct.entk_method.*hooks"):
        entk_features(model, torch.randn(2, 3), torch.arange(2), "jacobian")
