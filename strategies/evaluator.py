"""Evaluation on the server's copy of the data: the global model on every client's local test
split and on the global test set (no Flower imports)."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord

from task.analysis.linear_rep import global_gradient_norm, principal_angle_distance
from task.data.federated_data import FederatedData
from task.learning.engine import TensorData, fast_layout
from task.learning.inference import EvalResult, sample_scores
from task.learning.split_model import SplitModel


class ServerEvaluator:
    """Evaluates arrays centrally: on every client's local test split and on the global test set."""

    def __init__(self, fed: FederatedData, model: SplitModel, device: torch.device, batch_size: int) -> None:
        self.fed = fed
        self.model = model.to(device)
        self.batch = int(batch_size)
        self.regression = fed.bundle.task == "regression"
        test = fed.bundle.test
        self.test = TensorData.from_arrays(test.x, test.y, device)
        fast_layout(self.model, [self.test])
        self._pooled: tuple[tuple[int, ...], TensorData] | None = None
        self._scores: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._validation: TensorData | None = None
        self._validation_hits: torch.Tensor | None = None  # per held-out sample, for the loaded model

    def split(self, idx: np.ndarray) -> TensorData:
        """The test samples ``idx`` (of the server's test set) on the device."""
        t = torch.as_tensor(idx, dtype=torch.long, device=self.test.y.device)
        return TensorData(self.test.x[t], self.test.y[t])

    def load(self, arrays: ArrayRecord) -> None:
        """Copy ``arrays`` (a subset of the model's state is allowed) into the model."""
        self.model.load_state_dict(arrays.to_torch_state_dict(), strict=False)
        self._scores = None
        self._validation_hits = None

    def _score(self, idx: np.ndarray) -> EvalResult:
        """Loss and accuracy of the loaded model on the test samples ``idx``. Every sample of the
        server's test set is scored once per :meth:`load`, in one batched pass."""
        if self._scores is None:
            self._scores = sample_scores(self.model, self.test, self.batch, self.regression)
        loss, correct = self._scores
        t = torch.as_tensor(idx, dtype=torch.long, device=loss.device)
        hits = 0 if correct is None else int(correct[t].sum())
        return EvalResult(float(loss[t].double().sum()), hits, len(t), self.regression)

    def global_metric(self) -> tuple[float | None, float]:
        """Accuracy (None for regression) and loss of the loaded model on the global test set."""
        res = self._score(self.fed.global_test)
        return res.accuracy, res.loss

    def per_client(self, pids: list[int]) -> tuple[dict[int, float], dict[int, float]]:
        """Accuracy and loss of the loaded model on each client's local test split."""
        acc, loss = {}, {}
        for pid in pids:
            res = self._score(self.fed.client_test[pid])
            if res.accuracy is not None:
                acc[pid] = res.accuracy
            loss[pid] = res.loss
        return acc, loss

    def per_client_validation(self, pids: list[int]) -> dict[int, float]:
        """Accuracy of the loaded model on each client's validation part (``data.validation_fraction``;
        empty when the clients hold none, or for regression)."""
        if not self.fed.validating or self.regression:
            return {}
        if self._validation is None:  # every client's held-out samples, in partition order, built once
            held = np.concatenate(self.fed.client_validation)
            train = self.fed.bundle.train
            self._validation = TensorData.from_arrays(train.x[held], train.y[held], self.test.y.device)
        if self._validation_hits is None:
            self._validation_hits = sample_scores(self.model, self._validation, self.batch, False)[1]
        bounds = np.cumsum([0] + [len(v) for v in self.fed.client_validation])
        return {pid: float(self._validation_hits[bounds[pid]:bounds[pid + 1]].double().mean())
                for pid in pids if bounds[pid + 1] > bounds[pid]}

    def representation_metrics(self, arrays: ArrayRecord, pids: tuple[int, ...], global_model: bool) -> dict:
        """dist(B, B*) of a linear body; the global-loss gradient norm for a global model."""
        b = arrays.to_torch_state_dict()["body.weight"].double().numpy().T
        out = {"representation_distance": principal_angle_distance(b, self.fed.bundle.meta["B_star"])}
        if global_model:
            out["global_grad_norm"] = global_gradient_norm(self.model, self._pooled_train(pids))
        return out

    def _pooled_train(self, pids: tuple[int, ...]) -> TensorData:
        """All ``pids``' training samples on the device (built once per run)."""
        if self._pooled is None or self._pooled[0] != pids:
            train = self.fed.bundle.train
            idx = np.concatenate([self.fed.client_train[p] for p in pids])
            self._pooled = (pids, TensorData.from_arrays(train.x[idx], train.y[idx], self.test.y.device))
        return self._pooled[1]
