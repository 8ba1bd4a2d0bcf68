"""Training engine: batching, exact steps, FedProx term, head training on frozen features."""

import copy

import pytest
import torch
from torch.nn import functional as F

from task.learning.engine import OptimizerConfig, TensorData, seed_global_generators, train
from task.learning.heads import train_head_on_features
from task.learning.inference import evaluate
from task.learning.models import build_model


def _data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorData(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


def _model(seed=0):
    torch.manual_seed(seed)
    return build_model("digits_mlp", (1, 8, 8), 10)


def test_exact_number_of_steps_across_epochs():
    res = train(_model(), _data(40), OptimizerConfig(lr=0.1), 16, torch.Generator().manual_seed(0), steps=7)
    assert res.steps == 7
    assert res.samples == 16 + 16 + 8 + 16 + 16 + 8 + 16  # epochs of 40 split 16, 16, 8
    res = train(_model(), _data(40), OptimizerConfig(lr=0.1), 16, torch.Generator().manual_seed(0), epochs=2)
    assert res.steps == 6 and res.samples == 80


def test_same_generator_seed_gives_identical_training():
    data = _data()
    a, b = _model(), _model()
    for m in (a, b):
        train(m, data, OptimizerConfig(lr=0.1, momentum=0.9), 8, torch.Generator().manual_seed(3), epochs=2)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_prox_term_adds_mu_times_distance_to_start():
    data = _data(8)
    mu, lr = 0.5, 0.1
    model = _model()
    # one step without prox, then compare one step with prox from a shifted start
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    shifted = copy.deepcopy(model)
    train(model, data, OptimizerConfig(lr=lr), 8, torch.Generator().manual_seed(0), steps=1, prox_mu=mu)
    # with prox, anchor = shifted itself, so distance is 0 at the first step: equals plain SGD
    plain = copy.deepcopy(shifted)
    train(plain, data, OptimizerConfig(lr=lr), 8, torch.Generator().manual_seed(0), steps=1)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q)
    # second step differs by exactly -lr * mu * (w1 - w0)
    anchor_run = copy.deepcopy(shifted)
    train(anchor_run, data, OptimizerConfig(lr=lr), 8, torch.Generator().manual_seed(0), steps=2, prox_mu=mu)
    plain2 = copy.deepcopy(shifted)
    train(plain2, data, OptimizerConfig(lr=lr), 8, torch.Generator().manual_seed(0), steps=2)
    w1 = [p.detach() for p in model.parameters()]
    w0 = [p.detach() for p in shifted.parameters()]
    for a, b, x1, x0 in zip(anchor_run.parameters(), plain2.parameters(), w1, w0):
        torch.testing.assert_close(a, b - lr * mu * (x1 - x0), atol=1e-6, rtol=1e-5)


def _official_fedprox_steps(model, data, lr, momentum, weight_decay, mu, batch_size, generator, steps):
    """The official FedRep code's FedProx optimizer (FedProx.py), written out: weight decay and
    momentum on the gradient, then the pull mu·(w − w_start) added to the step."""
    from task.learning.engine import step_batches

    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    buffers = [None] * len(params)
    for idx in step_batches(len(data), batch_size, generator, data.y.device, None, steps):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(data.x[idx]), data.y[idx]).backward()
        with torch.no_grad():
            for i, (p, w0) in enumerate(zip(params, start)):
                d_p = p.grad + weight_decay * p
                buffers[i] = d_p.clone() if buffers[i] is None else buffers[i].mul_(momentum).add_(d_p)
                p.sub_(lr * (buffers[i] + mu * (p - w0)))


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_prox_pull_after_momentum_is_the_official_fedprox_step(momentum):
    data = _data(40)
    opt = OptimizerConfig(lr=0.1, momentum=momentum, weight_decay=1e-3)
    ours, official = _model(), _model()
    train(ours, data, opt, 8, torch.Generator().manual_seed(0), steps=12, prox_mu=2.0, prox_pull="after_momentum")
    _official_fedprox_steps(official, data, 0.1, momentum, 1e-3, 2.0, 8, torch.Generator().manual_seed(0), 12)
    for p, q in zip(ours.parameters(), official.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    # without momentum the pull's place makes no difference; with it, momentum carries the pull
    in_gradient = _model()
    train(in_gradient, data, opt, 8, torch.Generator().manual_seed(0), steps=12, prox_mu=2.0)
    same = all(torch.allclose(p, q, atol=1e-6) for p, q in zip(ours.parameters(), in_gradient.parameters()))
    assert same == (momentum == 0.0)


def test_without_bias_decay_only_the_weights_decay():
    def one_step(weight_decay: float, decay_biases: bool) -> dict[str, torch.Tensor]:
        model = _model()
        train(model, _data(), OptimizerConfig(0.1, momentum=0.5, weight_decay=weight_decay, decay_biases=decay_biases),
              8, torch.Generator().manual_seed(0), steps=1)
        return {name: p.detach() for name, p in model.named_parameters()}

    plain, official, decayed = one_step(0.0, True), one_step(0.5, False), one_step(0.5, True)
    biases = [name for name in plain if "bias" in name]
    assert biases and len(biases) < len(plain)
    for name in plain:
        if name in biases:
            assert torch.equal(official[name], plain[name]) and not torch.equal(decayed[name], plain[name]), name
        else:
            assert not torch.equal(official[name], plain[name]) and torch.equal(official[name], decayed[name]), name


def test_an_unknown_prox_pull_is_refused():
    with pytest.raises(ValueError, match="prox_pull.*'loss'"):
        train(_model(), _data(8), OptimizerConfig(lr=0.1), 8, torch.Generator().manual_seed(0), steps=1,
              prox_mu=1.0, prox_pull="loss")


def test_head_training_on_cached_features_matches_frozen_body_training():
    data = _data(30)
    head = ["fc2"]
    a, b = _model(), _model()
    opt = OptimizerConfig(lr=0.05, momentum=0.5)
    train_head_on_features(a, head, data, opt, 10, torch.Generator().manual_seed(1), epochs=3)
    train(b, data, opt, 10, torch.Generator().manual_seed(1), epochs=3, params=list(b.fc2.parameters()))
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5)
    # the body did not move
    for pa, pc in zip(a.fc1.parameters(), _model().fc1.parameters()):
        assert torch.equal(pa, pc)


def test_evaluate_counts_correct_predictions():
    model = _model()
    data = _data(50)
    res = evaluate(model, data)
    with torch.no_grad():
        out = model(data.x)
    assert res.correct == int((out.argmax(1) == data.y).sum())
    assert res.loss == pytest.approx(float(F.cross_entropy(out, data.y)), rel=1e-5)


def test_crop_flip_is_a_padded_crop_possibly_mirrored():
    from task.learning.engine import crop_flip

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 8, 8, generator=g)
    out = crop_flip(x, torch.Generator().manual_seed(1), padding=2)
    assert out.shape == x.shape
    padded = F.pad(x, (2, 2, 2, 2))
    flips = 0
    for i in range(64):
        windows = [padded[i, :, dy:dy + 8, dx:dx + 8] for dy in range(5) for dx in range(5)]
        plain = any(torch.equal(out[i], w) for w in windows)
        mirrored = any(torch.equal(out[i], w.flip(-1)) for w in windows)
        assert plain or mirrored
        flips += mirrored and not plain
    assert 10 < flips < 54  # about half are mirrored
    same = crop_flip(x, torch.Generator().manual_seed(1), padding=2)
    assert torch.equal(out, same)  # a pure function of the generator


def test_augmentation_needs_images():
    from flower_app.run.config import load_config, validate_with_data
    from task.errors import ConfigError

    with pytest.raises(ConfigError, match="train.augment"):
        validate_with_data(load_config("linear_fedrep", ["train.augment=crop_flip"]))


def test_a_head_trained_on_a_cpu_copy_ends_as_if_trained_in_place():
    """train_copy_on_cpu (small heads of a model on a GPU) runs the same batches and arithmetic."""
    from task.learning.heads import train_copy_on_cpu

    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Linear(8, 3))
    copy = torch.nn.Sequential(torch.nn.Linear(8, 3))
    copy.load_state_dict(head.state_dict())
    data = TensorData(torch.randn(40, 8), torch.randint(0, 3, (40,)))
    opt = OptimizerConfig(0.1, momentum=0.5, weight_decay=1e-3)
    in_place = train(head, data, opt, 10, torch.Generator().manual_seed(1), epochs=3)
    on_copy = train_copy_on_cpu(copy, data, opt, 10, torch.Generator().manual_seed(1), epochs=3)
    assert in_place.mean_loss == on_copy.mean_loss and in_place.steps == on_copy.steps == 12
    for a, b in zip(head.state_dict().values(), copy.state_dict().values()):
        assert torch.equal(a, b)


def test_bf16_precision_trains_in_autocast_but_evaluation_stays_float32():
    from task.learning.engine import precision

    torch.manual_seed(0)
    model = build_model("fedrep_cnn", (3, 32, 32), 10)
    data = TensorData(torch.randn(20, 3, 32, 32), torch.randint(0, 10, (20,)))
    fp32 = evaluate(model, data)
    with precision("bf16", torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu")
        assert model(data.x[:2]).dtype == torch.bfloat16  # training forward passes run in bf16
        inside = evaluate(model, data)
    assert (inside.loss_sum, inside.correct) == (fp32.loss_sum, fp32.correct)
    with precision("fp32", torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
    before = copy.deepcopy(model.state_dict())
    with precision("bf16", torch.device("cpu")):
        result = train(model, data, OptimizerConfig(0.05), 10, torch.Generator().manual_seed(0), epochs=1)
    assert result.steps == 2 and all(v.dtype == before[k].dtype for k, v in model.state_dict().items())
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_fast_layout_is_channels_last_for_convolutions_only_and_keeps_the_outputs():
    from task.learning.engine import fast_layout
    from task.learning.inference import predict

    torch.manual_seed(0)
    cnn = build_model("fedrep_cnn", (3, 32, 32), 10)
    images = TensorData(torch.randn(8, 3, 32, 32), torch.zeros(8, dtype=torch.long))
    before = predict(cnn, images.x)
    fast_layout(cnn, [images])
    assert images.x.is_contiguous(memory_format=torch.channels_last)
    assert cnn.state_dict()["conv1.0.weight"].is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(predict(cnn, images.x), before, rtol=1e-4, atol=1e-5)
    mlp = build_model("digits_mlp", (1, 8, 8), 10)
    flat = TensorData(torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    fast_layout(mlp, [flat])
    assert flat.x.is_contiguous()


def test_predictions_do_not_depend_on_the_chunk_size():
    from task.learning.inference import predict

    torch.manual_seed(0)
    model = build_model("lenet5", (3, 32, 32), 10)
    x = torch.randn(70, 3, 32, 32)
    torch.testing.assert_close(predict(model, x, batch_size=2048), predict(model, x, batch_size=7), rtol=1e-5, atol=1e-6)


def test_sample_scores_give_every_subset_the_metrics_of_evaluate():
    from task.learning.inference import sample_scores

    torch.manual_seed(0)
    model = build_model("digits_mlp", (1, 8, 8), 10)
    data = TensorData(torch.randn(50, 1, 8, 8), torch.randint(0, 10, (50,)))
    loss, correct = sample_scores(model, data)
    for idx in (torch.arange(50), torch.tensor([3, 3, 7, 40])):  # a client's split may repeat samples
        direct = evaluate(model, data.subset(idx))
        assert int(correct[idx].sum()) == direct.correct
        assert float(loss[idx].double().sum()) == pytest.approx(direct.loss_sum, rel=1e-6)


def test_a_bf16_context_around_a_whole_training_loop_trains_as_per_step_autocast_does():
    """The precision context spans many optimizer steps: every forward pass must cast the current
    weights (a cached cast would go stale after the first step and training would diverge)."""
    from task.learning.engine import batch_slices, precision

    torch.manual_seed(0)
    model = build_model("fedrep_cnn", (3, 32, 32), 10)
    reference = copy.deepcopy(model)
    data = TensorData(torch.randn(40, 3, 32, 32), torch.randint(0, 10, (40,)))
    opt = OptimizerConfig(0.05, momentum=0.5)
    with precision("bf16", torch.device("cpu")):
        train(model, data, opt, 10, torch.Generator().manual_seed(1), epochs=2)
    sgd = opt.build(list(reference.parameters()), reference)
    reference.train()
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        for idx in batch_slices(40, 10, generator, torch.device("cpu")):
            with torch.autocast("cpu", dtype=torch.bfloat16):  # the usual form: forward and loss only
                loss = F.cross_entropy(reference(data.x[idx]), data.y[idx])
            sgd.zero_grad(set_to_none=True)
            loss.backward()
            sgd.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)


def test_seeding_the_global_generators_on_a_cpu_draws_as_torch_manual_seed():
    seed_global_generators(7, torch.device("cpu"))
    ours = torch.rand(5), torch.nn.functional.dropout(torch.ones(8), 0.5)
    torch.manual_seed(7)
    assert torch.equal(ours[0], torch.rand(5)) and torch.equal(ours[1], torch.nn.functional.dropout(torch.ones(8), 0.5))
