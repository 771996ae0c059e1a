"""What every paged backend shares: the staged batch inputs and the generic metadata ops.

Importing the package registers the generic ops (``ops`` for uniform batches,
``ragged_ops`` for the per-token metadata of extend batches, ``row_ops`` for the
row layouts of speculative batches), whose ``torch``
providers (``torch_ref``, ``ragged_ref``) are the exact references and whose
``triton`` providers (``triton_kernels``, ``ragged_triton``) are the fast path,
bit-equal to them.
"""

from backends.common import ops, ragged_ops, row_ops  # noqa: F401  (registers ops)
