"""How roles stream over the data plane in ``--fully-async``: the streaming roles (reference, advantages) and the
trainer's chunks. Used by the loops and by the placements that run roles elsewhere."""
