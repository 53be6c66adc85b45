"""What the masters step costs: following in-place edits ([Note: master weights] in
hf_zero/_masters.py), and per owned element against Trainer's default bf16 step.

``python -m benchmarks.masters_check``

One process, rank 0 of a fake 2-rank process group (collectives are no-ops), the bf16
GPT-2 of benchmarks.e2e with fp32 masters, one thread: times the per-step check (one
version-counter read per owned piece), the re-derivation after every param was written
(what a step after ``clamp_`` of every weight pays once), a full compare of every owned
element (the alternative the check avoids), and hf_zero's local step (no sync: fake
collectives), each the median of repeated runs; then torch's fused AdamW (Trainer's default,
``adamw_torch_fused``) stepping bf16 copies of the same owned elements with bf16 state, interleaved
with hf_zero's step, per element.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks.e2e import FULL, template_model
    from hf_zero import ZeroBucketOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    model = template_model(FULL["model"], "bfloat16")
    opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, fused=True)  # zero_bucket's inner
    batch = torch.randint(0, FULL["model"]["vocab_size"], (1, FULL["seq"]))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    part = opt._partition  # a benchmark may look inside
    masters = [lp.master for lp in part.pieces if lp.master is not None]
    owned = sum(m.tensor.numel() for m in masters)
    check = _median_ms(part.follow_edits, 200)

    def edited():
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0)  # a write: moves every counter, changes no value
        part.follow_edits()

    rederive = _median_ms(edited, 5)
    compare = _median_ms(lambda: [bool((m.tensor.to(m.view.dtype) != m.view).any()) for m in masters], 5)
    step = _median_ms(opt.step, 5)  # the grads are kept: the same local step each time
    print(f"owned master pieces {len(masters)}, elements {owned:,} of {sum(p.numel() for p in model.parameters()):,}")
    print(f"per-step check: {check * 1e3:.1f} us = {check / step:.4%} of hf_zero's local step; after every param "
          f"was written: {rederive:.1f} ms; full compare of every owned element: {compare:.1f} ms; hf_zero local "
          f"step (fake sync): {step:.1f} ms")
    # Trainer's default on the same elements: bf16 params, grads and state, one fused step.
    same = [torch.nn.Parameter(m.view.detach().clone()) for m in masters]
    for p, m in zip(same, masters):
        p.grad = torch.randn_like(p)
    default = torch.optim.AdamW(same, lr=1e-4, fused=True)
    ours, theirs = [], []
    for _ in range(7):  # interleaved: the machine's load moves both alike
        ours.append(_median_ms(opt.step, 3))
        theirs.append(_median_ms(default.step, 3))
    ours_ns, theirs_ns = (statistics.median(t) * 1e6 / owned for t in (ours, theirs))
    print(f"per owned element: hf_zero's masters step {ours_ns:.3f} ns, the default's bf16 fused step "
          f"{theirs_ns:.3f} ns, ratio {ours_ns / theirs_ns:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
