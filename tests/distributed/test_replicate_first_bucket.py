"""replicate's first bucket closes at 1 MiB, as torch's DDP does: the gradients ready first
(the last layers) start their all-reduce while the rest of backward still runs, instead of
the whole model waiting for one 25 MB bucket at the end of backward."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import replicate
from composable_shard._runtime import collectives as _collectives
from tests._harness import run_distributed

WIDTH = 384  # one Linear: 384 * 385 * 4 B = 0.56 MiB, so the first two layers in backward order fill 1 MiB


def _first_bucket() -> None:
    torch.manual_seed(0)
    model = replicate(nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)]))  # default bucket_cap_mb=25
    reference = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    reference.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    model[0].register_full_backward_pre_hook(lambda module, grad_output: _collectives.trace("layer0_backward"))
    layer_bytes = WIDTH * (WIDTH + 1) * 4
    rank, world_size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    for step in range(2):  # before and after the bucket rebuild
        x = torch.randn(world_size * 2, WIDTH, generator=g)
        with _collectives.record_collectives() as rec:
            model(x[rank * 2:(rank + 1) * 2]).pow(2).mean().backward()
        buckets = [r for r in rec.records if r.tag.startswith("replicate::bucket")]
        assert [r.nbytes for r in buckets] == [2 * layer_bytes, 2 * layer_bytes], \
            f"step {step}: bucket bytes {[r.nbytes for r in buckets]}, expected the last two layers, then the first two"
        events = rec.events
        early = [e for e in events[:events.index(("trace", "layer0_backward", ""))]
                 if e[0] == "collective" and e[2].startswith("replicate::bucket")]
        assert len(early) == 1, f"step {step}: the first bucket's all-reduce did not start before layer 0's backward"
        reference(x).pow(2).mean().backward()  # the mean over every rank's rows
        pairs = list(zip(model.named_parameters(), reference.parameters()))
        assert len(pairs) == len(list(reference.parameters())) == 8
        for (name, p), q in pairs:
            assert torch.allclose(p.grad, q.grad, atol=1e-6), f"step {step} {name}: grad differs from local"
        model.zero_grad()
        reference.zero_grad()


def test_first_bucket_closes_at_one_mib() -> None:
    """Four 0.56 MiB layers, default 25 MB cap, W=2: two buckets (the last two layers, then the
    first two), the first all-reduced before layer 0's backward; gradients equal local ones."""
    run_distributed(_first_bucket, 2, timeout=60)
