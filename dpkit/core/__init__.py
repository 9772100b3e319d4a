"""The ground floor: plain types and units that every layer of dpkit shares.

Nothing here imports from a floor above it (engines, the registry, the subsystems):
byte units and model-state figures (:mod:`.units`), the :class:`~.strategy.Strategy`
value, what a launcher asked for (:mod:`.launch`), what the plan knows of a model and a
request (:mod:`.spec`), the storage-counting ledger engines fill (:mod:`.walk`,
:mod:`.categories`), the sharded checkpoint's vocabulary (:mod:`.shards`), fp16's
loss scalers (:mod:`.loss_scale`) and the one markdown table formatter (:mod:`.tables`).
``tests/test_layers.py`` enforces the floors.
"""
