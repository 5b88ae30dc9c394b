"""The public surface: exports, docstrings (documented Args match signatures), type checking,
and the rule that the library never imports torch's own FSDP/DDP/composable runtimes.

Without these, a renamed argument leaves a stale docstring, an untyped change slips in, and a
convenient import of torch's FSDP would quietly make us a wrapper of what we compete with.
"""

from __future__ import annotations

import inspect
import pathlib
import re
import subprocess
import sys

import composable_shard

PACKAGE = pathlib.Path(composable_shard.__file__).parent
EXPECTED_EXPORTS = {
    "contract", "fully_shard", "replicate", "checkpoint", "FSDPModule", "ReplicateModule",
    "ShardingStrategy", "BackwardPrefetch", "MixedPrecision", "CPUOffload",
    "StateDictType", "FullStateDictConfig", "ShardedStateDictConfig",
    "ModuleWrapPolicy", "CustomPolicy", "always_wrap_policy", "lambda_auto_wrap_policy",
    "transformer_auto_wrap_policy", "size_based_auto_wrap_policy", "enable_wrap", "wrap",
    "unshard_params", "state_dict_type", "clip_grad_norm_",
    "get_model_state_dict", "set_model_state_dict", "get_optimizer_state_dict", "set_optimizer_state_dict",
    "ShardedSlice", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "export_safetensors",
    "describe",
}


def test_exports_exist_and_are_documented() -> None:
    """Every name API.md lists that this release implements is importable and documented."""
    assert EXPECTED_EXPORTS <= set(composable_shard.__all__), EXPECTED_EXPORTS - set(composable_shard.__all__)
    for name in composable_shard.__all__:
        obj = getattr(composable_shard, name)
        assert (obj.__doc__ or "").strip(), f"{name} has no docstring"


def test_every_export_has_an_entry_in_docs_api() -> None:
    """docs/api.md has a section (a ``### `name` `` heading) for every public symbol, and none
    for a name that is not exported: the reference cannot fall behind the package."""
    api_md = (PACKAGE.parent / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^### `(\w+)`", api_md, re.M))
    exported = set(composable_shard.__all__)
    assert exported - documented == set(), f"not in docs/api.md: {sorted(exported - documented)}"
    assert documented - exported == set(), f"docs/api.md documents names not exported: {sorted(documented - exported)}"


def test_version_matches_pyproject() -> None:
    """``composable_shard.__version__`` is the installed version, and the fallback for an
    uninstalled source tree is pyproject.toml's version."""
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)  # type: ignore[union-attr]  # present
    fallback = re.search(r'^    __version__ = "([^"]+)"', (PACKAGE / "__init__.py").read_text(), re.M)
    assert fallback is not None and fallback.group(1) == version
    assert composable_shard.__version__ == version


def _documented_args(doc: str) -> list:
    match = re.search(r"\n\s*Args:\n(.*?)(\n\s*\n|\Z)", doc, re.S)
    if not match:
        return []
    return re.findall(r"^\s{4,}(\w+)(?: \(.*?\))?:", match.group(1), re.M)


def test_documented_args_match_signatures() -> None:
    """A docstring's Args section names exactly the function's parameters, in order."""
    checked = 0
    for name in composable_shard.__all__:
        obj = getattr(composable_shard, name)
        fn = getattr(obj, "__wrapped__", obj)
        if not callable(fn) or inspect.isclass(fn):
            continue
        documented = _documented_args(fn.__doc__ or "")
        if not documented:
            continue
        params = [p for p in inspect.signature(fn).parameters if p not in ("self",)]
        params = [p for p in params if not inspect.signature(fn).parameters[p].kind.name.startswith("VAR")]
        assert documented == params, f"{name}: documented {documented} vs signature {params}"
        checked += 1
    assert checked >= 3, checked


def test_library_never_imports_torch_data_parallel_runtimes() -> None:
    """torch's FSDP (1 and 2), _composable and DistributedDataParallel are references for
    tests and benchmarks only."""
    forbidden = re.compile(r"torch\.distributed\.fsdp|torch\.distributed\._composable|DistributedDataParallel|"
                           r"from torch\.distributed import fsdp|torch\.nn\.parallel")
    for path in PACKAGE.glob("*.py"):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if ("import" in code or "torch." in code) and forbidden.search(code):
                raise AssertionError(f"{path.name}:{lineno}: {line.strip()}")


def test_private_torch_uses_are_isolated() -> None:
    """Private torch APIs appear only in _torch_compat.py."""
    private = re.compile(r"_execution_engine|\._parameters\[|torch\._C\.|torch\.utils\._")
    for path in PACKAGE.glob("*.py"):
        if path.name == "_torch_compat.py":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if private.search(line.split("#")[0]):
                raise AssertionError(f"{path.name}:{lineno}: private torch use outside _torch_compat: {line.strip()}")


def test_package_type_checks() -> None:
    """mypy passes on the whole package (type hints are part of the contract)."""
    result = subprocess.run([sys.executable, "-m", "mypy", "--ignore-missing-imports", "--no-error-summary",
                             str(PACKAGE)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
