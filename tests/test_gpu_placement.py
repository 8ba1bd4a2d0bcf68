"""Several GPUs: the ClientApps spread over every visible GPU, and the server evaluates on the one
it is given. Checked with pretend GPUs (a faked device count, and Ray started with 4 fake GPUs),
so it runs on CPU-only machines too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from flower_app.run import simulation
from flower_app.run.config import load_config, server_device
from task.errors import ConfigError


@pytest.mark.parametrize("cpus, client_cpus, gpus, share", [
    (16, 1, 4, 0.25),   # 16 ClientApps at once, 4 on each GPU
    (16, 1, 2, 0.125),
    (16, 2, 3, 1 / 3),  # 8 at once: 3, 3 and 2
    (2, 1, 4, 1.0),     # fewer ClientApps than GPUs: a GPU each
    (8, 1, 0, 0.0),
])
def test_the_gpu_share_puts_the_same_number_of_clientapps_on_each_gpu(cpus, client_cpus, gpus, share):
    assert simulation.gpu_share(cpus, client_cpus, gpus) == pytest.approx(share)


def test_client_gpus_zero_on_a_gpu_machine_spreads_and_an_explicit_share_is_kept(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(simulation.os, "cpu_count", lambda: 16)
    sim = OmegaConf.create({"client_cpus": 1, "client_gpus": 0.0, "device": "auto", "ray_address": None})
    assert simulation.client_gpus_of(sim) == 0.25
    sim.client_gpus = 0.1
    assert simulation.client_gpus_of(sim) == 0.1
    sim.client_gpus, sim.device = 0.0, "cpu"
    assert simulation.client_gpus_of(sim) == 0.0


#: Ray with 16 CPUs and 4 pretend GPUs; 16 actors of the given share; the GPU ids each was given.
PLACEMENT = """
import json, sys, ray
ray.init(address="local", num_cpus=16, num_gpus=4, include_dashboard=False, logging_level="ERROR")
share = float(sys.argv[1])
@ray.remote(num_cpus=1, num_gpus=share)
class ClientApp:
    def gpus(self):
        return [str(g) for g in ray.get_gpu_ids()]
actors = [ClientApp.remote() for _ in range(16)]
print(json.dumps(ray.get([a.gpus.remote() for a in actors])))
ray.shutdown()
"""


def _placement(share: float) -> list[list[str]]:
    done = subprocess.run([sys.executable, "-c", PLACEMENT, str(share)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_ray_puts_the_spread_share_on_every_gpu_where_a_tenth_packs_them():
    spread = _placement(simulation.gpu_share(16, 1, 4))
    assert sorted(sum(spread, [])) == sorted(["0", "1", "2", "3"] * 4)  # four ClientApps on each GPU
    packed = _placement(0.1)
    assert len({g for ids in packed for g in ids}) < 4  # ten on a GPU before the next: one GPU stays idle


def test_the_server_evaluates_on_the_gpu_it_is_given(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = load_config("quickstart", ["eval.server_device=cuda:1"])
    assert server_device(cfg) == torch.device("cuda:1")
    cfg = load_config("quickstart", ["simulation.device=cpu"])
    assert server_device(cfg) == torch.device("cpu")  # null: the clients' device
    for name, message in [("cuda:2", "torch sees 2 CUDA GPU"), ("gpu", "is not a device")]:
        cfg = load_config("quickstart", [f"eval.server_device={name}"])
        with pytest.raises(ConfigError, match=f"eval.server_device: .*{message}"):
            server_device(cfg)
