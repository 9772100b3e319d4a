"""F1 as an ``evaluate`` metric module, shipped with dpkit because the Hub is not reachable.

Load with ``evaluate.load(path_to_this_folder)``; same inputs and output as the
Hub's ``f1`` (binary by default, ``average="macro"`` for more classes).
"""

import datasets
import evaluate
from sklearn.metrics import f1_score


class F1(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="Harmonic mean of precision and recall.",
            citation="",
            inputs_description="predictions and references: lists of integer class ids.",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(
        self,
        predictions,
        references,
        labels=None,
        pos_label=1,
        average="binary",
        sample_weight=None,
    ):
        score = f1_score(
            references,
            predictions,
            labels=labels,
            pos_label=pos_label,
            average=average,
            sample_weight=sample_weight,
        )
        return {"f1": float(score)}
