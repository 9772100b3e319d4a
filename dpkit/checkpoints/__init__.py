"""Checkpoints: the full training state, sharded or gathered, resumable under every strategy and world size.

* :mod:`~dpkit.checkpoints.checkpointer`: :class:`~dpkit.checkpoints.checkpointer.Checkpointer`
  (save and restore from the training loop; :meth:`dpkit.Run.save_checkpoint` drives it)
  and :class:`~dpkit.checkpoints.checkpointer.Position`, where training stands;
* :mod:`~dpkit.checkpoints.folder`: a checkpoint folder's layout, its state file and
  manifest, checked before a resume trusts it;
* :mod:`~dpkit.checkpoints.resume`: which checkpoint ``--resume`` names, and what carries over;
* :mod:`~dpkit.core.shards`: the default layout, every rank writing its own part
  of the weights and moments with torch Distributed Checkpoint, read back by any layout;
* :mod:`~dpkit.checkpoints.state`: the weights, Adam moments, RNG streams and fp16 loss
  scale, gathered and restored through the run's engine (``--checkpoint-format full``);
* :mod:`~dpkit.checkpoints.warm_start`: ``--init-from``, a checkpoint's weights as the
  start of a new run (another head or task), not a resume;
* :mod:`~dpkit.checkpoints.consolidate`: ``dpkit consolidate``, a DeepSpeed checkpoint
  into a model folder.
"""
