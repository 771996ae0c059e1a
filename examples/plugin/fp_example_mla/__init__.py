"""An example forward-planner backend, packaged on its own: FlashMLA-style decode metadata.

Importing the package registers its op (``fp_example_mla.ops``) and its plan schema
(``fp_example_mla.plan``, backend ``example-mla``); the ``forward_planner.backends`` entry
point in ``pyproject.toml`` makes the planner import it. ``docs/backends.md`` explains each
part; ``tests/`` shows how a plugin tests itself with the library's helpers.
"""

from fp_example_mla import ops
from fp_example_mla.plan import MLADecodePlan

__all__ = ["MLADecodePlan", "ops"]
