"""What one checkpoint call costs in resident memory, alone in one process (issue 27).

``MALLOC_MMAP_THRESHOLD_=65536 python -m benchmarks.save_cost``: a GPT-2 of 19M params (fp32),
one ``ZeroBucketOptimizer`` step (params are bucket views), then each call with the kernel's
high-water mark reset right before it (``/proc/self/clear_refs``); prints MiB above the resident
size before the call.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch


def _mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _peak(call) -> float:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _mib("VmRSS")
    call()
    return _mib("VmHWM") - before


def main() -> int:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_zero import ZeroBucketOptimizer, _offline
    from hf_zero.integrations.accelerate import separate_views_in_state_dict

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=512, n_layer=6, n_head=4, use_cache=False))
    opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    toks = torch.randint(0, 256, (1, 64))
    model(input_ids=toks, labels=toks).loss.backward()
    opt.step()
    out = tempfile.mkdtemp()
    model.save_pretrained(os.path.join(out, "warm"))
    sizes = (sum(p.nbytes for p in model.parameters()) / 2**20, opt.stats()["state_bytes_per_rank"][0] / 2**20)
    print(f"model {sizes[0]:.1f} MiB, optimizer state {sizes[1]:.1f} MiB")
    print(f"save_pretrained, bucket views:                {_peak(lambda: model.save_pretrained(os.path.join(out, 'a'))):.1f} MiB")
    separate_views_in_state_dict(model)
    print(f"save_pretrained, views as separate storages:  {_peak(lambda: model.save_pretrained(os.path.join(out, 'b'))):.1f} MiB")
    print(f"save_sharded:                                 {_peak(lambda: opt.save_sharded(os.path.join(out, 'ck'))):.1f} MiB")
    plain = os.path.join(out, "optimizer.pt")
    print(f"write_plain_optimizer (16 MiB pieces):        "
          f"{_peak(lambda: _offline.write_plain_optimizer(os.path.join(out, 'ck'), plain)):.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
