"""Linear-representation metrics (FedRep Section 4, FedAvg-FT Theorem 1): in the multi-task
linear setting (ground truth B* known, a model with a ``body`` group) every evaluation records
the principal-angle distance dist(B, B*) of the shared body and, for a global model, the norm of
the global loss's gradient; after training, new linear tasks fit a least-squares head on n
samples with the learned B (FedRep Figure 4) and the error |Bw - B*w*|^2 is recorded per n.
"""

from __future__ import annotations

from logging import INFO

from flwr.app import Message
from flwr.common.logger import log

from protocols.base import PaperProtocol
from strategies import ALGORITHMS
from strategies.services import Services
from task.analysis.linear_rep import new_client_errors


class LinearRepresentation(PaperProtocol):
    """dist(B, B*) and gradient norms per evaluation; new-task errors after training."""

    name = "linear_rep"

    def active(self, services: Services) -> bool:
        return ("B_star" in services.data.bundle.meta and "body" in services.model.group_names
                and ALGORITHMS[services.cfg.algorithm].shared_keys is not None)

    def on_evaluate(self, server_round: int, record: dict, replies: list[Message], services: Services) -> None:
        global_model = services.strategy.has_global_model(server_round)
        record.update(services.evaluator.representation_metrics(services.get_arrays(), tuple(services.trainable),
                                                                global_model))

    def after_training(self, services: Services) -> None:
        cfg, meta = services.cfg, services.data.bundle.meta
        b = services.get_arrays().to_torch_state_dict()["body.weight"].double().numpy().T
        errors = new_client_errors(b, meta["B_star"], list(cfg.new_clients.samples), int(cfg.new_clients.tasks),
                                   float(meta["noise"]), float(cfg.data.synthetic.head_scale), int(cfg.seed))
        log(INFO, "[flrep] new linear clients, error |Bw - B*w*|^2 by samples n: %s (local only: %s)",
            {n: f"{e:.3g}" for n, e in errors["head_on_learned_b"].items()},
            {n: f"{e:.3g}" for n, e in errors["local_only"].items()})
        services.log({"round": int(cfg.rounds), "phase": "newclients", "newclient_error": errors["head_on_learned_b"],
                      "newclient_error_local_only": errors["local_only"]}, stamp=False)  # a computation, no traffic

    def summary(self, records: list[dict], services: Services) -> dict:
        out: dict = {}
        evals = [r for r in records if r["phase"] == "eval"]
        if evals:
            out["representation_distance"] = evals[-1].get("representation_distance")
            out["global_grad_norm"] = evals[-1].get("global_grad_norm")
        for record in records:
            if record["phase"] == "newclients" and "newclient_error" in record:
                out["newclient_error"] = record["newclient_error"]
                out["newclient_error_local_only"] = record["newclient_error_local_only"]
        return out
