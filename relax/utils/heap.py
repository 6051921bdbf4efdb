"""The long-lived part of a process's Python heap, left out of the cyclic garbage collector.

Importing torch, transformers and Relax, then building the roles (models, engines, datasets), leaves hundreds of
thousands of objects that live as long as the process. Python's collector still walks all of them at every full
collection, and a training run allocates enough (tensors, samples, metrics) to trigger full collections all along:
a tiny `relax train` run (6 steps in a fresh interpreter, 2-core CPU) spent about a quarter of its time there
(6.5 s -> 5.0 s with them frozen). `gc.freeze` moves every object alive now into a permanent generation that
collections skip; objects made later are collected as before, and freezing again later adds the new survivors.
The cost: garbage cycles alive at a freeze are never freed (there is no collection first: it would cost about as
much as it saves in a short run, for a few hundred kilobytes). Called where a process has done its imports or built
what it keeps (a `relax` command before it runs, `relax train` once its roles are placed, a role's Ray process once
its role is built, the test suite after collection).
"""

from __future__ import annotations

import gc


def freeze_long_lived_objects() -> None:
    """Keep every object alive now out of later collections (module docstring)."""
    gc.freeze()
