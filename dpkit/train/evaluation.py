"""Evaluating on every rank: a classifier (loss, accuracy and F1 as scikit-learn scores them) and a causal LM (loss and perplexity).

The figures are scikit-learn's ``accuracy_score`` and ``f1_score`` (what the ``evaluate``
metric modules shipped with dpkit, ``dpkit/metrics``, compute for Trainer scripts),
counted here with scikit-learn's own arithmetic, bit for bit (tests/test_byo_input.py
compares them on random splits): a run imports neither ``evaluate``, whose package
import pulls in transformers' pipelines (3.4 s on a CPU core after transformers), nor
``sklearn.metrics`` (3.1 to 4.1 s after transformers on every rank, measured on the
shared 2-core CI box).
``gather_for_metrics`` drops the samples the last uneven batch duplicates across
ranks, so 1 and N processes count every sample once.
"""

from __future__ import annotations

from typing import Any


class ClassifierMetrics:
    """Accuracy and F1 for a classifier with ``num_labels`` classes.

    F1 averages by the label set, not by the labels a split happens to contain:
    binary for two classes, macro otherwise; the key says which (``f1_binary``,
    ``f1_macro``).
    """

    def __init__(self, num_labels: int) -> None:
        self.num_labels = num_labels
        self.average = "binary" if num_labels == 2 else "macro"
        self.f1_key = f"f1_{self.average}"

    def evaluate(self, run: Any, model: Any, loader: Any) -> dict[str, float]:
        """Predict ``loader`` on every rank (a collective) and score it: accuracy, F1 and
        the mean cross-entropy per example (``loss``); the model is left in training mode.
        ``run``: the :class:`~dpkit.train.run.Run` the model was prepared by."""
        import torch

        accelerator = run.accelerator
        model.eval()
        predictions, references, losses = [], [], []
        for batch in loader:
            with torch.no_grad():
                logits = model(**batch).logits
                per_example = torch.nn.functional.cross_entropy(
                    logits.float(), batch["labels"], reduction="none"
                )
            preds, labels, batch_losses = accelerator.gather_for_metrics(
                (logits.argmax(dim=-1), batch["labels"], per_example)
            )
            predictions += preds.tolist()
            references += labels.tolist()
            losses += batch_losses.tolist()
        run.evaluation_done(model)  # FSDP2 shard-grad-op keeps whole parameters after a forward
        model.train()
        result = self.score(predictions, references)
        result["loss"] = sum(losses) / len(losses) if losses else float("nan")
        return result

    def score(self, predictions: list[int], references: list[int]) -> dict[str, float]:
        """Accuracy and F1 of class ids (and how many samples they cover), as
        scikit-learn's ``accuracy_score`` and ``f1_score(average=...)`` give them: F1 of a
        class 2 tp / (true + predicted), 0.0 where both are 0 (scikit-learn's
        ``zero_division`` default); binary F1 is class 1's, macro F1 the mean over the
        classes that occur in either list, taken by numpy as scikit-learn takes it."""
        import numpy as np

        predictions, references = list(predictions), list(references)  # arrays too
        if not references or len(references) != len(predictions):
            raise ValueError(
                f"cannot score {len(predictions)} predictions against {len(references)} labels"
            )
        pairs = list(zip(predictions, references, strict=True))

        def f1_of(label: int) -> float:
            true_positives = sum(p == label and r == label for p, r in pairs)
            denominator = references.count(label) + predictions.count(label)
            return 2 * true_positives / denominator if denominator else 0.0

        if self.average == "binary":
            f1 = f1_of(1)
        else:
            labels = sorted(set(references) | set(predictions))
            f1 = float(np.mean(np.array([f1_of(label) for label in labels], dtype=np.float64)))
        return {
            "samples": len(references),
            "accuracy": sum(p == r for p, r in pairs) / len(references),
            self.f1_key: f1,
        }


class CausalLMMetrics:
    """Loss and perplexity of a causal LM over the tokens that carry the loss.

    The loss is the mean cross-entropy per loss token of the whole split (a prompt's
    tokens, labelled -100, carry none), as ``model(**batch).loss`` computes it per batch
    (logits at position t predict the label at t + 1); perplexity is its exponential.
    Each example's sum and token count are gathered with ``gather_for_metrics``, so the
    samples the last uneven batch repeats across ranks count once, at any world size.
    """

    def evaluate(self, run: Any, model: Any, loader: Any) -> dict[str, float]:
        """Score ``loader`` on every rank (a collective); the model is left in training
        mode. ``run``: the :class:`~dpkit.train.run.Run` the model was prepared by."""
        import math

        import torch

        accelerator = run.accelerator
        model.eval()
        loss_sum, tokens, samples = 0.0, 0, 0
        for batch in loader:
            with torch.no_grad():
                logits = model(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                ).logits
                labels = batch["labels"][:, 1:]
                per_token = torch.nn.functional.cross_entropy(
                    logits[:, :-1].float().transpose(1, 2), labels, ignore_index=-100,
                    reduction="none",
                )  # fmt: skip
                counted = labels != -100
                example_sums = (per_token * counted).sum(dim=1, dtype=torch.float64)
                example_tokens = counted.sum(dim=1)
            example_sums, example_tokens = accelerator.gather_for_metrics(
                (example_sums, example_tokens)
            )
            loss_sum += float(example_sums.sum())
            tokens += int(example_tokens.sum())
            samples += int(example_tokens.numel())
        run.evaluation_done(model)  # FSDP2 shard-grad-op keeps whole parameters after a forward
        model.train()
        loss = loss_sum / tokens if tokens else float("nan")
        return {
            "samples": samples,
            "tokens": tokens,
            "loss": loss,
            "perplexity": math.exp(min(loss, 709.0)),  # nan stays nan; no overflow
        }
