"""Several ranks on torch.distributed: process groups, per-step agreement, the FFN exchange.

- ``group``: joining the job (NCCL on GPUs, gloo on the CPU, a gloo host group for
  the per-step metadata), timeouts, ``torchrun`` variables and a local spawn;
- ``agree``: a few integers proven equal on every rank with one small all-reduce;
- ``tp``: tensor-parallel checks around each forward (batch signature; plan digests
  in debug mode);
- ``dp``: data-parallel attention's per-step agreement (which forwards run, at which
  graph size; idle ranks run IDLE batches);
- ``exchange``: the FFN's row all-gather every forward (the lockstep a skipped step
  would break).

Sits above ``planner`` and ``graphs``; ``serving`` builds engines on it. See
``docs/distributed.md``.
"""
