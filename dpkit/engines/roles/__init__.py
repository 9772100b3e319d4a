"""The questions an engine answers, one role per module (:mod:`dpkit.engines.base` composes them).

* :mod:`.settings`: the launch, the flags and the backend's configuration, before any group;
* :mod:`.wrapping`: around ``accelerator.prepare``, and the check after it;
* :mod:`.knobs`: what the bench and the tune read and vary;
* :mod:`.measured`: where the training state lives, counted (``engine.memory``);
* :mod:`.planned`: the bytes per rank, predicted, without torch (``engine.plan``);
* :mod:`.checkpoint_io`: weights and moments saved and restored (``engine.checkpoints``);
* :mod:`.views`: what the roles read of the objects that the layers above own, as Protocols.
"""
