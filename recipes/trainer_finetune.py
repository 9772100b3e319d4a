"""Fine-tune MiniLM on Rotten Tomatoes with the plain Transformers ``Trainer``, plus dpkit's memory report.

The Trainer code people already have, with two callbacks added
(:class:`dpkit.integrations.transformers.MemoryReportCallback`, and
:class:`~dpkit.integrations.transformers.StepPhasesCallback`: where each step's time
goes, in the Trainer's logs) and DeepSpeed's buckets sized to the model
(:func:`~dpkit.integrations.transformers.deepspeed_config`).
Every ``TrainingArguments`` flag works (``--per_device_train_batch_size``,
``--learning_rate``, ``--max_steps``, ``--report_to``...). From the repository root:

    python recipes/trainer_finetune.py --output_dir runs/trainer
    torchrun --nproc_per_node 8 recipes/trainer_finetune.py --output_dir runs/trainer-ddp
    deepspeed --num_gpus 8 recipes/trainer_finetune.py --deepspeed ds_configs/zero2.json --output_dir runs/trainer-zero2
    deepspeed --num_gpus 8 recipes/trainer_finetune.py --deepspeed ds_configs/zero3.json --output_dir runs/trainer-zero3
    deepspeed --num_gpus 8 recipes/trainer_finetune.py --deepspeed ds_configs/zero2_offload.json --output_dir runs/trainer-zero2-offload
    accelerate launch --config_file ds_configs/accelerate/zero2.yaml --num_processes 8 recipes/trainer_finetune.py --output_dir runs/trainer-zero2
    dpkit plan --against runs/trainer-zero2

On a machine without CUDA the same commands run the processes on CPU with gloo
(``use_cpu=True, ddp_backend="gloo"``: :func:`~dpkit.integrations.transformers.device_arguments`).
``--zero_settings config`` runs the DeepSpeed config as written (the Trainer fills its
``"auto"`` values), to compare with dpkit's settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

import datasets
import evaluate
import numpy as np
import transformers
from transformers import (
    AutoModelForSequenceClassification,
    DataCollatorWithPadding,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)

import dpkit
from dpkit import models
from dpkit.data import classification
from dpkit.integrations.transformers import (
    MemoryReportCallback,
    StepPhasesCallback,
    deepspeed_config,
    device_arguments,
    log_once_per_job,
    metric_dir,
)


@dataclass
class ExampleArguments:
    """What the example adds to ``TrainingArguments``."""

    model: str = field(
        default=dpkit.ModelConfig.model, metadata={"help": "Hub name or local folder."}
    )
    dataset: str = field(
        default=dpkit.DataConfig.dataset,
        metadata={"help": "The built-in data, a CSV/JSON(L) file with text and label columns."},
    )
    max_seq_length: int = field(default=128, metadata={"help": "Tokens per example."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep N train examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep N eval examples."})
    zero_settings: str = field(
        default="dpkit",
        metadata={
            "help": "dpkit: ZeRO buckets and gradient layout sized to the model; config: the "
            "DeepSpeed config as written (the Trainer fills its 'auto' values).",
            "choices": ["dpkit", "config"],
        },
    )
    memory_report_every: int = field(
        default=0, metadata={"help": "Also report memory every N steps (0: at the end)."}
    )
    memory_report: bool = field(
        default=True,
        metadata={
            "help": "Add dpkit's MemoryReportCallback and StepPhasesCallback (false: the bare Trainer)."
        },
    )
    cpu_arguments: bool = field(
        default=True,
        metadata={
            "help": "On a machine without CUDA pass use_cpu=True and ddp_backend='gloo' "
            "(false: the Trainer's defaults, which train unconnected copies there)."
        },
    )


def parse_args() -> tuple[ExampleArguments, dict]:
    """The example's arguments, and the ``TrainingArguments`` ones as keywords: they are
    built once the model exists, since the DeepSpeed config is sized to it."""
    parser = HfArgumentParser((ExampleArguments, TrainingArguments))
    parser.set_defaults(
        output_dir="runs/trainer_finetune",
        per_device_train_batch_size=16,
        per_device_eval_batch_size=64,
        learning_rate=5e-5,
        num_train_epochs=1,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        do_eval=True,
    )
    namespace = parser.parse_args()
    example = ExampleArguments(
        **{f.name: getattr(namespace, f.name) for f in fields(ExampleArguments)}
    )
    training = {f.name: getattr(namespace, f.name) for f in fields(TrainingArguments) if f.init}
    return example, training


def main() -> None:
    example, training = parse_args()
    log_once_per_job()  # library warnings once per job, not once per rank
    datasets.disable_progress_bars()  # one bar: the Trainer's
    transformers.utils.logging.disable_progress_bar()
    model_path, hf_config = models.load_model_config(example.model)
    data_cfg = dpkit.DataConfig(
        dataset=example.dataset,
        max_train_samples=example.max_train_samples,
        max_eval_samples=example.max_eval_samples,
    )
    splits, label_names = classification.load_data_splits(data_cfg)
    splits = data_cfg.truncate(splits)
    tokenizer = models.load_tokenizer(model_path, example.model, hf_config)
    labels = models.classifier_labels(label_names, tokenizer)
    # The two dpkit lines for a Trainer: ZeRO's buckets sized to the model (the config
    # from --deepspeed or from `accelerate launch`), and what a CPU run needs. The model's
    # shapes are enough (meta device): a bad DeepSpeed config stops before the weights load.
    if example.zero_settings == "dpkit":
        shapes = models.meta_classifier(model_path, **labels)
        training["deepspeed"] = deepspeed_config(shapes, training["deepspeed"])
    if example.cpu_arguments:
        training.update(device_arguments(training["deepspeed"]))
    # Before the model: under ZeRO-3 the arguments make from_pretrained load it
    # partitioned, under deepspeed.zero.Init (transformers' HfDeepSpeedConfig).
    args = TrainingArguments(**training)
    transformers.set_seed(training["seed"])
    # from_pretrained, with the load report's table one line when all it says is a new head
    model = models.load_pretrained(AutoModelForSequenceClassification, model_path, **labels)

    tokenized = splits.map(
        lambda batch: tokenizer(batch["text"], truncation=True, max_length=example.max_seq_length),
        batched=True,
        remove_columns=["text"],
    )
    accuracy = evaluate.load(str(metric_dir("accuracy")))

    def compute_metrics(prediction) -> dict:
        logits, labels = prediction
        return accuracy.compute(predictions=np.argmax(logits, axis=-1), references=labels)

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8),
        compute_metrics=compute_metrics,
        callbacks=[
            MemoryReportCallback(
                report_every=example.memory_report_every, model_name=example.model
            ),
            StepPhasesCallback(),
        ]
        if example.memory_report
        else [],
    )
    trainer.train()
    if args.do_eval:
        trainer.evaluate()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # N processes x tokenizer threads
    dpkit.run_and_exit(main)
