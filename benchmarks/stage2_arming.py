"""What stage 2 adds to each backward to arm its reducer, on a GPT-2 124M graph (issue 30).

``OMP_NUM_THREADS=1 python -m benchmarks.stage2_arming``: GPT-2 124M (fp32, CPU, batch 1,
sequence 64), gradient checkpointing off, reentrant and non-reentrant. Inside the backward (a
prehook on the loss's node, where the reducer arms) it times, in microseconds per call (the
least of 7 blocks of calls):

- ``will_run x148``: whether the backward reaches each param, with the params' ``AccumulateGrad``
  nodes held (what the reducer does), and re-fetched each time (what it did before);
- ``walk``: the search for a reentrant checkpoint node below the outputs (the reducer runs it
  only when a param is unreached, once per set of unreached params; it stops at the first node
  found, and without one visits the whole graph);
- ``output flatten``: the forward hook's flattening of the ``ModelOutput`` (every forward).
"""

from __future__ import annotations

import time

import torch

from hf_zero._engine import grad_accumulator, reentrant_region_below, running_node, tree_tensors, will_run


def _best(fn, n: int = 20, blocks: int = 7) -> float:
    out = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
    return round(min(out), 1)


def main() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    for kind, reentrant in (("off", None), ("reentrant", True), ("non-reentrant", False)):
        model = GPT2LMHeadModel(GPT2Config(use_cache=False)).train()
        if reentrant is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        params = list(model.parameters())
        ids = torch.randint(0, model.config.vocab_size, (1, 64))
        out = model(input_ids=ids, labels=ids)
        res: dict = {}

        def in_backward(grad_outputs) -> None:
            root = running_node()
            nodes = [grad_accumulator(p) for p in params]
            res[f"will_run x{len(params)} held nodes"] = _best(lambda: [will_run(x) for x in nodes])
            res[f"will_run x{len(params)} nodes re-fetched"] = _best(
                lambda: [will_run(grad_accumulator(p)) for p in params], n=5)
            res["params reached"] = sum(will_run(x) for x in nodes)
            res["walk"] = _best(lambda: reentrant_region_below(root), n=5)

        out.loss.grad_fn.register_prehook(in_backward)

        def flatten() -> None:
            leaves, _ = tree_tensors(out)
            {t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None}

        res["output flatten"] = _best(flatten)
        out.loss.backward()
        print(f"checkpointing {kind}: {res}")


if __name__ == "__main__":
    main()
