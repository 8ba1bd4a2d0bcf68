"""Blocking runs of this Flower app in Flower's simulation engine.

``flwr run .`` streams logs from a detached local SuperLink and exits 0 even when the
ServerApp crashed. For tests, sweeps and benchmarks, :func:`run_blocking` starts the same
ServerApp/ClientApp components (read from ``[tool.flwr.app.components]``) in Flower's
simulation runtime inside this process, waits for the end and raises when the run failed.
It uses the runtime entry point that ``flwr-simulation`` itself calls, so a Flower
upgrade must be checked against it (flwr is pinned in pyproject.toml).

Ray is started here, before Flower's backend would start it, so that its processes live in
process groups of their own and this process catches the stop signals after Ray installed its
handlers: a signal to flrep's group (Ctrl-C, ``timeout``, a scheduler) reaches flrep alone, which
stops the engine in order (see :mod:`flower_app.run.stop_signals`).
"""

from __future__ import annotations

import functools
import math
import logging
import os
import shlex
import sys
from logging import INFO
from typing import NoReturn

from flwr.common.logger import log
from omegaconf import DictConfig

from flower_app.run.config import PROJECT_DIR as APP_DIR, visible_gpus
from flower_app.run.console import verbose_chosen
from flower_app.run.message_delivery import one_pass_delivery
from flower_app.run.ray_cluster import alive_nodes, check_fits, check_nodes, join, worker_env
from flower_app.run.stop_signals import catch, stopping_on_signals
from strategies.state_store import SIMULATION_ENV
from task.errors import ConfigError


def run_blocking(experiment: str, overrides: list[str], num_supernodes: int, client_cpus: float, client_gpus: float,
                 ray_address: str | None = None) -> None:
    """Run the app in the simulation engine until it ends; raise if the ServerApp failed. With
    ``ray_address`` the engine runs on that Ray cluster (:mod:`flower_app.run.ray_cluster`)."""
    # the engine's modules (Ray among them) load here, after the configuration was checked
    from flwr.app import Context, RecordDict
    from flwr.common.config import get_fused_config_from_dir, get_project_config
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.server.superlink.linkstate.utils import generate_rand_int_from_bytes
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.constant import NOOP_FEDERATION_ID
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.supercore.telemetry import EventType

    if not (APP_DIR / "pyproject.toml").is_file():
        raise RuntimeError(f"flrep run needs the app's source tree (pyproject.toml) at {APP_DIR}; install with 'pip install -e .'")
    components = get_project_config(APP_DIR)["tool"]["flwr"]["app"]["components"]
    override = {"experiment": experiment, "overrides": shlex.join(overrides)}
    run = Run.create_empty(run_id=generate_rand_int_from_bytes(8))
    run.override_config = override
    run.primary_task_id = generate_rand_int_from_bytes(8)
    run.federation_id = NOOP_FEDERATION_ID
    TaskIdentity.task_id = run.primary_task_id
    TaskIdentity.run_id = run.run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    context = Context(
        run_id=run.run_id,
        node_id=0,
        node_config={},
        state=RecordDict(),
        run_config=get_fused_config_from_dir(APP_DIR, override),
    )
    os.environ[SIMULATION_ENV] = "1"  # the simulated nodes (Ray workers inherit it) share this machine's disk
    backend_config = {
        "client_resources": {"num_cpus": client_cpus, "num_gpus": client_gpus},
        "init_args": engine_init_args(),
    }
    with stopping_on_signals():
        if ray_address:
            join(ray_address, backend_config["init_args"])
        else:
            _start_ray(backend_config["init_args"])
        catch(on_stop=_quiet_engine)  # after Ray's SIGTERM handlers (a C++ stack dump, then exit 1 or 15)
        with one_pass_delivery():  # Flower's own delivery costs nodes × messages per sweep
            _run_simulation(
                num_supernodes=num_supernodes,
                exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE,
                server_app_attr=components["serverapp"],
                client_app_attr=components["clientapp"],
                backend_config=backend_config,
                app_dir=str(APP_DIR),
                run=run,
                server_app_context=context,
                is_app=True,
            )


def engine_init_args() -> dict[str, object]:
    """Ray's start options: quiet, and the ClientApps' output (Ray's worker lines) reaches this
    process only with --verbose (their failures come back in their replies and are logged here)."""
    return {"logging_level": "ERROR", "log_to_driver": verbose_chosen()}


def _start_ray(init_args: dict[str, object]) -> None:
    """Start Ray as Flower's backend would (which then uses it), each process Ray starts (GCS,
    raylet, agents; the raylet's workers join the raylet's) in a process group of its own.

    A Ray of this process's own (``address="local"``), even where ``ray start`` left the address of
    its cluster in Ray's temp folder: Ray would join that cluster, and wait for ever on one that is
    gone. A ``RAY_ADDRESS`` in the environment still names the Ray to join."""
    import ray
    from ray._private import services

    if ray.is_initialized():
        return
    pythonpath = worker_env()["PYTHONPATH"]
    os.environ["PYTHONPATH"] = pythonpath  # as Flower does: Ray's processes import what this one can
    popen = services.ConsolePopen
    services.ConsolePopen = functools.partial(popen, process_group=0)
    try:
        ray.init(address="local", runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, include_dashboard=False,
                 **init_args)
    finally:
        services.ConsolePopen = popen


def _quiet_engine() -> None:
    """Once stopped, the engine's threads would log each ClientApp the stop ends as an error."""
    logging.getLogger("flwr").disabled = True


def check_resources(sim: DictConfig) -> None:
    """The ``simulation.*`` resources of each simulated ClientApp fit this machine, or a node of the
    Ray cluster at ``simulation.ray_address`` (joined here), else Ray's actor pool stays empty and the
    run would wait forever: a ConfigError naming the key."""
    client_cpus, client_gpus = float(sim.client_cpus), float(sim.client_gpus)
    if sim.get("ray_address"):
        join(str(sim.ray_address), engine_init_args())
        check_fits(client_cpus, client_gpus, alive_nodes())
        return
    cores = os.cpu_count() or 1
    if client_cpus > cores:
        raise ConfigError(f"simulation.client_cpus={client_cpus:g}: this machine has {cores} CPU cores; "
                          f"a ClientApp can ask for at most {cores}")
    if client_gpus == 0 and sim.device == "cpu":
        return
    gpus = visible_gpus()
    if sim.device == "cuda" and gpus == 0:
        raise ConfigError("simulation.device=cuda, but torch sees no CUDA GPU on this machine; use auto or cpu")
    if client_gpus > gpus:
        raise ConfigError(f"simulation.client_gpus={client_gpus:g}: this machine has {gpus} CUDA GPU(s); "
                          f"use {'0' if gpus == 0 else f'at most {gpus}'}")


def gpu_share(cpus: float, client_cpus: float, gpus: float) -> float:
    """The GPU fraction per ClientApp that spreads the ClientApps running at once (as many as
    ``cpus // client_cpus``) evenly over ``gpus`` GPUs: Ray fills one GPU with fractions before the
    next, so a share of 1/ceil(ClientApps / GPUs) puts the same number on each (0 without a GPU)."""
    if gpus <= 0:
        return 0.0
    at_once = max(1, int(cpus // client_cpus))
    return 1.0 / math.ceil(at_once / gpus)


def client_gpus_of(sim: DictConfig) -> float:
    """``simulation.client_gpus``; when it is 0 and the clients may use a GPU (``device`` cuda, or
    auto with a GPU in sight), :func:`gpu_share` of this machine's (or the cluster's) CPUs and GPUs."""
    if float(sim.client_gpus) > 0 or sim.device == "cpu":
        return float(sim.client_gpus)
    if sim.get("ray_address"):
        total = {k: sum(float(n.get("Resources", {}).get(k, 0)) for n in alive_nodes()) for k in ("CPU", "GPU")}
        cpus, gpus = total["CPU"], total["GPU"]
    else:
        cpus, gpus = float(os.cpu_count() or 1), float(visible_gpus())
    share = gpu_share(cpus, float(sim.client_cpus), gpus)
    if share > 0:
        log(INFO, "[flrep] simulation.client_gpus=0 on %g GPU(s): each ClientApp gets %g of one, so the %d that run "
            "at once spread over every GPU", gpus, share, max(1, int(cpus // float(sim.client_cpus))))
    return share


def check_simulation(cfg: DictConfig, experiment: str, overrides: list[str]) -> None:
    """:func:`check_resources`, and on a Ray cluster the start-up check of every node
    (:func:`flower_app.run.ray_cluster.check_nodes`) for the run ``experiment`` with ``overrides``."""
    check_resources(cfg.simulation)
    if cfg.simulation.ray_address:
        from flower_app.app.outcome import output_dir

        check_nodes(experiment, overrides, output_dir(cfg))


def exit_interrupted(code: int) -> NoReturn:
    """Leave an interrupted simulation at once: its ServerApp and backend threads would wait
    forever for replies that no longer come, so stop Ray and exit without joining them."""
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
