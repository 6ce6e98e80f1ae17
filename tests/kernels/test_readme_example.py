"""The attention-kernel example of docs/kernels.md runs as written and agrees with the jnp reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxserve import kernels as pk

README = Path(__file__).resolve().parents[2] / "docs" / "kernels.md"


def _example() -> str:
    section = README.read_text().split("## Attention kernels", 1)[1]
    return section.split("```python", 1)[1].split("```", 1)[0]


def test_readme_attention_example():
    scope: dict = {}
    exec(compile(_example(), str(README), "exec"), scope)  # noqa: S102 - our own README
    out = scope["out"]
    assert out.shape == (21, 8, 64)
    args = [scope[name] for name in ("q", "k_cache", "v_cache", "block_table", "kv_lens", "cu_q_lens")]
    ref = pk.ragged_paged_attention_reference(*args, 2, sm_scale=64**-0.5)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=2e-2)
    # The written K/V landed in the slots the example names: block 3 holds the prompt's first 16 tokens.
    assert np.asarray(scope["k_cache"], np.float32)[3].any() and not np.asarray(scope["k_cache"], np.float32)[4].any()
