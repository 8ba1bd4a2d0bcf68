"""LG-FedAvg's official selection (main_lg.py; ``new_test.models=best``): the client half and the
server's averaging, orchestrated by :class:`strategies.lg_fedavg.LGFedAvg` (see its module docstring)."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from omegaconf import DictConfig

from strategies.common import ARRAYS, ClientRuntime, reply, round_config
from strategies.state_store import keep_arrays, kept_arrays

SELECT = "query.lgselect"  # new_test.models=best: score the best local part with the averaged global part
SELECTED_ROUND = "lg-selected-round"  # config: the round selected so far (-1: none)
BEST_LOCAL = "lg-best-local"  # the local part of the client's best Local Test evaluation in LG ...
BEST_SCORE = "lg-best"  # ... and its accuracy and round
CANDIDATE = "lg-candidate"  # the last selection's model (best local part, averaged global part) ...
CANDIDATE_ROUND = "lg-candidate-round"  # ... and its round
SELECTED = "lg-selected"  # the candidate of the selected round: the New Test model


def selects(cfg: DictConfig) -> bool:
    """Whether the run makes main_lg.py's selection (``new_test.models=best`` with New Test on)."""
    return bool(cfg.new_test.enabled) and cfg.new_test.models == "best"


def keep_if_best(rt: ClientRuntime, accuracy: float, server_round: int, local: list[str]) -> None:
    """Keep the local part (state keys ``local``) if this LG evaluation is at least as good as every
    earlier one (main_lg.py: the latest of ties)."""
    best = kept_arrays(rt, BEST_SCORE)
    if best is None or accuracy >= float(best["accuracy"]):
        state = rt.model.state_dict()
        keep_arrays(rt, BEST_LOCAL, {k: state[k] for k in local})
        keep_arrays(rt, BEST_SCORE, {"accuracy": torch.tensor(float(accuracy), dtype=torch.float64),
                                     "round": torch.tensor(server_round)})


def update_best(client_best: dict[str, list], accuracies: dict[str, float], server_round: int) -> None:
    """The server's copy of the clients' rule: partition id -> [accuracy, round] of its best evaluation."""
    for pid, acc in accuracies.items():
        if pid not in client_best or acc >= client_best[pid][0]:  # main_lg.py: >=
            client_best[pid] = [acc, server_round]


def average_of_best(client_best: dict[str, list], global_of_round: dict[int, ArrayRecord]) -> ArrayRecord:
    """The mean over clients of the global part each one's best evaluation was made with."""
    parts = [global_of_round[r].to_torch_state_dict() for _, r in client_best.values()]
    return ArrayRecord({k: torch.stack([p[k] for p in parts]).mean(dim=0) for k in parts[0]})


def keep_selected(rt: ClientRuntime, config: ConfigRecord) -> None:
    """The last candidate becomes the client's New Test model when the server selected its round."""
    candidate = kept_arrays(rt, CANDIDATE_ROUND)
    if candidate is not None and int(candidate["round"]) == int(config.get(SELECTED_ROUND, -1)):
        keep_arrays(rt, SELECTED, kept_arrays(rt, CANDIDATE))


def select_lg(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """main_lg.py's selection: the best local part with the received average of the best models'
    global parts, kept as this round's candidate; its Local Test."""
    config = round_config(content)
    keep_selected(rt, config)
    rt.load(content[ARRAYS])
    best_local = kept_arrays(rt, BEST_LOCAL)
    if best_local is None:
        raise ValueError(f"client {rt.partition_id} has no best LG evaluation to select from")
    rt.load(ArrayRecord(best_local))
    keep_arrays(rt, CANDIDATE, rt.model.state_dict())
    keep_arrays(rt, CANDIDATE_ROUND, {"round": torch.tensor(int(config["server-round"]))})
    return reply(None, **rt.evaluate_local(config))
