"""The library needs torch alone: a two-rank job runs with numpy made unimportable.

The test extras (``transformers``) bring numpy into the test environment, so without this test
a new numpy dependency would pass the suite and break a user's install (it happened:
``dist.all_gather_object`` needs numpy, and the README's main command crashed on a fresh
virtual environment). ``sitecustomize`` on ``PYTHONPATH`` blocks numpy in every process
torchrun starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_JOB = textwrap.dedent('''
    import os, sys
    assert sys.modules.get("numpy", 0) is None, "numpy is not blocked"
    import torch, torch.distributed as dist, torch.nn as nn
    from composable_shard import checkpoint, clip_grad_norm_, fully_shard, replicate, unshard_params

    os.environ["COMPOSABLE_SHARD_DEBUG"] = "1"  # every agreement check, every step
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4))
    checkpoint(model[2])
    fully_shard(model[2])
    replicate(model[3])
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        clip_grad_norm_(model, 1.0)
        optim.step()
        optim.zero_grad()
    with unshard_params(model, with_grads=False):
        assert model[0].weight.shape == (16, 8)
    # A sharded checkpoint (torch.distributed.checkpoint exchanges its plans as objects).
    from composable_shard import get_model_state_dict, load_checkpoint, save_checkpoint
    path = os.path.join(os.environ["CHECKPOINT_ROOT"], "step_3")
    save_checkpoint(path, model, optim)
    before = {k: v.clone() for k, v in get_model_state_dict(model).items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_checkpoint(path, model, optim)
    after = get_model_state_dict(model)
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
    dist.barrier()
    dist.destroy_process_group()
    print("ok without numpy", flush=True)
''')


def test_two_rank_job_runs_without_numpy(tmp_path: Path) -> None:
    """fully_shard (lazy-init checks, debug-mode agreement), replicate, checkpoint,
    clip_grad_norm_, unshard_params, and a sharded save_checkpoint/load_checkpoint round trip on
    2 gloo ranks with numpy unimportable."""
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["numpy"] = None\n')
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(repo)]), CHECKPOINT_ROOT=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        cwd=repo, env=env, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert output.count("ok without numpy") == 2, output[-4000:]
