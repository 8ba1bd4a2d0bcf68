"""The run configuration's schema: the core's sections as structured configs, plus the section
each registered algorithm and paper protocol declares (``Algorithm.config``,
``PaperProtocol.config``). Values and their documentation live in ``conf/base.yaml``; a field
without a default here must be given there (or by a plug-in's own defaults).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from omegaconf import MISSING

from protocols import PROTOCOLS
from strategies import ALGORITHMS
from strategies.checks import below_one, fraction, nonnegative, one_of, positive, unit_interval
from task.data.datasets.femnist import FEMNIST_CLASS_MODES
from task.data.partition import CLASS_ASSIGNMENT_MODES, PARTITIONS
from task.data.sources import DATASET_NAMES
from task.learning.models import MODEL_NAMES, OUTPUTS


@dataclass
class ModelConfig:
    name: one_of(MODEL_NAMES) = MISSING  # type: ignore[valid-type]
    head: Optional[list[str]] = MISSING
    init: Literal["default", "scaled_orthonormal"] = MISSING
    output: one_of(OUTPUTS) = MISSING  # type: ignore[valid-type]


@dataclass
class OnlineDeviceConfig:
    enabled: bool = MISSING
    train_size: int = positive()
    test_size: int = positive()
    quarter_turns: int = MISSING


@dataclass
class SyntheticConfig:
    d: int = positive()
    k: int = positive()
    n_train: int = positive()
    n_test: int = positive()
    noise: float = nonnegative()
    head_scale: float = positive()
    whiten: bool = MISSING
    seed: int = MISSING


@dataclass
class QuadraticConfig:
    d: int = positive()
    mu: float = positive()
    L: float = positive()
    C: float = nonnegative()
    shared_basis: bool = MISSING
    seed: int = MISSING


@dataclass
class DataConfig:
    name: one_of(DATASET_NAMES) = MISSING  # type: ignore[valid-type]
    source: Literal["local", "hub"] = MISSING
    root: Optional[str] = MISSING
    hub_id: Optional[str] = MISSING
    cache_dir: str = MISSING
    normalize: bool = MISSING
    num_clients: int = positive()
    num_new_clients: int = nonnegative()
    online_device: OnlineDeviceConfig = field(default_factory=OnlineDeviceConfig)
    new_client_classes: Optional[list[int]] = MISSING
    new_client_classes_per_client: int = positive()
    new_client_train_size: int = positive()
    new_client_test_size: int = positive()
    partition: one_of(PARTITIONS) = MISSING  # type: ignore[valid-type]
    classes_per_client: int = positive()
    class_assignment_mode: one_of(CLASS_ASSIGNMENT_MODES) = MISSING  # type: ignore[valid-type]
    dirichlet_alpha: float = positive()
    min_partition_size: int = nonnegative()
    dirichlet_self_balancing: bool = MISSING
    shards_per_client: int = positive()
    shard_size: Optional[int] = positive()
    test_per_client: Optional[int] = positive()
    validation_fraction: float = below_one()
    split_seed: int = MISSING
    test_fraction: float = fraction()
    femnist_classes: one_of(FEMNIST_CLASS_MODES) = MISSING  # type: ignore[valid-type]
    femnist_test_fraction: float = fraction()
    image_channels: int = positive()
    adult_missing: Literal["keep", "drop"] = MISSING
    adult_include_protected: bool = MISSING
    adult_split: Literal["uci", "fairness"] = MISSING
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    quadratic: QuadraticConfig = field(default_factory=QuadraticConfig)


@dataclass
class TrainConfig:
    fraction: float = fraction()
    local_epochs: int = positive()
    local_steps: Optional[int] = positive()
    batch_size: int = positive()
    lr: float = positive()
    momentum: float = nonnegative()
    weight_decay: float = nonnegative()
    decay_biases: bool = MISSING
    nesterov: bool = MISSING
    lr_decay: float = positive()
    augment: Literal["none", "crop_flip"] = MISSING
    precision: Literal["fp32", "bf16"] = MISSING
    aggregation: Literal["examples", "uniform"] = MISSING  # weights of every average of client models


@dataclass
class ServerOptConfig:
    name: str = MISSING  # which names an algorithm accepts is its own (``Algorithm.server_opts``)
    lr: float = positive()
    momentum: float = below_one()
    beta_1: float = below_one()
    beta_2: float = below_one()
    tau: float = positive()


@dataclass
class EvalConfig:
    every: int = positive()
    final_window: int = nonnegative()
    batch_size: int = positive()
    server_device: Optional[str] = MISSING


@dataclass
class SimulationConfig:
    client_cpus: float = positive()
    client_gpus: float = nonnegative()
    device: Literal["auto", "cpu", "cuda"] = MISSING
    ray_address: Optional[str] = MISSING


@dataclass
class ClientStateConfig:
    dir: Optional[str] = MISSING
    disk_above_bytes: int = nonnegative()


@dataclass
class FaultsConfig:
    min_replies: int = positive()
    max_skipped_fraction: float = unit_interval()
    reply_timeout_s: Optional[float] = positive()
    node_wait_s: float = nonnegative()
    allow_unserved: bool = MISSING


@dataclass
class WandbConfig:
    enabled: bool = MISSING
    project: str = MISSING
    entity: Optional[str] = MISSING
    mode: Optional[str] = MISSING


def _core_fields() -> list[tuple[str, Any, Any]]:
    """The core's keys: the run's identity and the sections every algorithm shares."""
    return [
        ("algorithm", one_of(tuple(ALGORITHMS)), MISSING),
        ("label", Optional[str], None),
        ("plugins", list[str], MISSING),
        ("compare", list[str], MISSING),
        ("seed", int, nonnegative()),
        ("rounds", int, positive()),
        ("smoke", bool, MISSING),
        ("model", ModelConfig, field(default_factory=ModelConfig)),
        ("data", DataConfig, field(default_factory=DataConfig)),
        ("train", TrainConfig, field(default_factory=TrainConfig)),
        ("server_opt", ServerOptConfig, field(default_factory=ServerOptConfig)),
        ("eval", EvalConfig, field(default_factory=EvalConfig)),
        ("simulation", SimulationConfig, field(default_factory=SimulationConfig)),
        ("client_state", ClientStateConfig, field(default_factory=ClientStateConfig)),
        ("faults", FaultsConfig, field(default_factory=FaultsConfig)),
        ("resume", Optional[str], MISSING),
        ("wandb", WandbConfig, field(default_factory=WandbConfig)),
        ("out_dir", Optional[str], MISSING),
        ("experiment", str, ""),  # set by load_config: the experiment file's name
    ]


def declared_sections() -> dict[str, type]:
    """Section name -> structured config of every registered algorithm and protocol."""
    owners = [(a.section or a.name, a.config, f"algorithm {a.name!r}") for a in ALGORITHMS.values()]
    owners += [(p.section or p.name, p.config, f"protocol {p.name!r}") for p in PROTOCOLS]
    sections: dict[str, type] = {}
    claimed: dict[str, str] = {}
    core = {name for name, _, _ in _core_fields()}
    for section, config, owner in owners:
        if config is None:
            continue
        if section in core or (section in sections and sections[section] is not config):
            raise ValueError(f"{owner} declares config section {section!r}, which "
                             f"{claimed.get(section, 'the core')} already declares")
        sections[section], claimed[section] = config, owner
    return sections


def run_schema() -> type:
    """The whole run configuration's structured config, for the algorithms registered now."""
    fields = [(name, tp, default if isinstance(default, dataclasses.Field) else field(default=default))
              for name, tp, default in _core_fields()]
    fields += [(name, config, field(default_factory=config)) for name, config in declared_sections().items()]
    return dataclasses.make_dataclass("RunConfig", fields)
