"""Stage 2: hf_zero's own gradient reducer, grads sharded as the backward produces them.

The parts, each a file:

- ``reducer.py``: what happens to a grad, from autograd into a reduce bucket, reduce-scattered
  into this rank's shard ([Note: stage 2 reducer], [Note: arming a backward], [Note: what stage
  2 accumulates in]);
- ``plan.py``: which params share a bucket, in what order, and where each grad lies (pure);
- ``pool.py``: the buckets kept from one backward to the next ([Note: bucket pool]);
- ``grads.py``: the sharded grads the step, clipping and a GradScaler read ([Note: agreeing on
  presence], [Note: a forward without its backward]);
- ``stand_ins.py``: what ``p.grad`` holds between backward and step ([Note: p.grad stands in
  for the shards]);
- ``buffers.py``: rank 0's params and buffers ([Note: buffers after a syncing backward]);
- ``hooks.py``: the hooks on the bound module and its params, shared by every reducer bound to it
  ([Note: several optimizers over one module], [Note: forward hooks under torch.compile]);
- ``carrier.py``: the reduce bucket that carries the layout check ([Note: the check rides a bucket]).

docs/stage2.md says what users see; docs/stage2_internals.md compares it with DDP's path.
"""

from .carrier import carrier_of
from .grads import ShardedGrads
from .plan import (
    AUTO_GRAD_ACCUM_DTYPE, DEFAULT_BUCKET_CAP_MB, GRAD_ACCUM_DTYPES, MAX_IN_FLIGHT, accumulate_dtype, buckets_in_flight,
    plan_buckets, shard_dtype,
)
from .reducer import Reducer, memory, memory_peaks, stands_in

__all__ = [
    "AUTO_GRAD_ACCUM_DTYPE", "DEFAULT_BUCKET_CAP_MB", "GRAD_ACCUM_DTYPES", "MAX_IN_FLIGHT", "Reducer", "ShardedGrads",
    "accumulate_dtype", "buckets_in_flight", "carrier_of", "memory", "memory_peaks", "plan_buckets", "shard_dtype", "stands_in",
]
