"""The package's public names: `from jaxserve import LLM, SamplingParams` as vLLM users write it, without
making the host-only modules (scheduler, block manager, inputs) load jax."""

from __future__ import annotations

import subprocess
import sys

import pytest

import jaxserve


def test_public_names_resolve_to_their_modules():
    from jaxserve import LLM, SamplingParams
    from jaxserve.llm import LLM as llm_class
    from jaxserve.sampling import SamplingParams as params_class

    assert LLM is llm_class and SamplingParams is params_class
    assert sorted(jaxserve.__all__) == sorted(jaxserve._EXPORTS)
    for name in jaxserve.__all__:
        assert getattr(jaxserve, name) is not None


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Engine2'"):
        _ = jaxserve.Engine2


def test_host_modules_do_not_load_jax():
    code = (
        "import sys, jaxserve, jaxserve.block_manager, jaxserve.scheduler, jaxserve.buckets, jaxserve.variants, "
        "jaxserve.step_inputs; "
        "assert 'jax' not in sys.modules, 'jax was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_module_imports_first():
    """Each module of the package imports in an interpreter where no other jaxserve module has been imported
    (a user's `from jaxserve.models.loader import load_model` as the first line): an import cycle between
    modules shows up only in some orders. One interpreter, the package's modules dropped from sys.modules before
    each import (jax stays loaded); a missing optional dependency (tunix) is not a failure."""
    code = """
import importlib, pkgutil, sys
import jaxserve
failures = []
for info in sorted(pkgutil.walk_packages(jaxserve.__path__, "jaxserve."), key=lambda m: m.name):
    for key in [k for k in sys.modules if k == "jaxserve" or k.startswith("jaxserve.")]:
        del sys.modules[key]
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as e:
        if e.name.split(".")[0] == "jaxserve":
            failures.append(f"{info.name}: {e}")
    except ImportError as e:
        failures.append(f"{info.name}: {e}")
assert not failures, "\\n".join(failures)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
