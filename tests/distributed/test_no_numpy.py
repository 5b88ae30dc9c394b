"""Training needs torch alone: a two-rank job runs with numpy made unimportable; only the
checkpoints need numpy (a declared dependency: torch.distributed.checkpoint decodes the plans
its ranks exchange with ``Tensor.numpy()``), and without it they raise on every rank, naming it.

The test extras (``transformers``) bring numpy into the test environment, so without this test
a new use of numpy would pass the suite and break a training job (it happened:
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
    # Checkpoints need numpy (torch.distributed.checkpoint decodes its plans with it): each
    # rank raises, naming it, before any collective (no rank is left waiting) and writes nothing.
    from composable_shard import load_checkpoint, save_checkpoint
    path = os.path.join(os.environ["CHECKPOINT_ROOT"], "step_3")
    for call in (save_checkpoint, load_checkpoint):
        try:
            call(path, model, optim)
        except ImportError as e:
            assert f"{call.__name__} needs numpy" in str(e) and "pip install numpy" in str(e), e
        else:
            raise AssertionError(f"{call.__name__} ran without numpy")
    assert not any(name.startswith("step_3") for name in os.listdir(os.environ["CHECKPOINT_ROOT"]))
    dist.barrier()
    dist.destroy_process_group()
    print("ok without numpy", flush=True)
''')


def test_two_rank_job_runs_without_numpy(tmp_path: Path) -> None:
    """fully_shard (lazy-init checks, debug-mode agreement), replicate, checkpoint,
    clip_grad_norm_ and unshard_params on 2 gloo ranks with numpy unimportable; save_checkpoint
    and load_checkpoint raise ImportError naming numpy on every rank."""
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
