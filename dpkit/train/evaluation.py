"""Evaluating on every rank: a classifier (loss, accuracy and F1 from scikit-learn) and a causal LM (loss and perplexity).

scikit-learn's ``accuracy_score`` and ``f1_score`` are what the ``evaluate`` metric
modules shipped with dpkit (``dpkit/metrics``, for Trainer scripts) compute too; called
directly, a run does not import ``evaluate``, whose package import pulls in
transformers' pipelines (3.4 s on a CPU core after transformers, measured alone; a
2-process launch of the recipe's short test run starts about 1 s sooner without it).
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
        """Accuracy and F1 of class ids (and how many samples they cover)."""
        from sklearn.metrics import accuracy_score, f1_score

        return {
            "samples": len(references),
            "accuracy": float(accuracy_score(references, predictions)),
            self.f1_key: float(f1_score(references, predictions, average=self.average)),
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
