"""Accuracy as an ``evaluate`` metric module, shipped with dpkit because the Hub is not reachable.

Load with ``evaluate.load(path_to_this_folder)``; same inputs and output as the
Hub's ``accuracy``.
"""

import datasets
import evaluate
from sklearn.metrics import accuracy_score


class Accuracy(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="Fraction of predictions equal to the reference labels.",
            citation="",
            inputs_description="predictions and references: lists of integer class ids.",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        score = accuracy_score(
            references, predictions, normalize=normalize, sample_weight=sample_weight
        )
        return {"accuracy": float(score)}
