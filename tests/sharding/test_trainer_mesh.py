"""Serving on a trainer's mesh: `LLM.from_params(..., mesh=, mesh_axes=)` over parameters a dp=2 x tp=2
trainer holds (its own axis names, FSDP over one axis, tensor parallelism over the other) gives the
single-device dense reference's greedy tokens; `update_weights` from that layout compiles nothing, and from
another layout on another device order reshards without touching the compiled steps or the fuser; the
old buffers are freed.

jax fixes its device count when it starts, so the check runs in a fresh process with four host devices.
"""

from __future__ import annotations

import textwrap

import pytest

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # tests/conftest.py says why

CHECK = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    import transformers
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from jaxserve.config import CompileConfig
    from jaxserve.dense import generate_dense
    from jaxserve.llm import LLM
    from jaxserve.sampling import SamplingParams
    from jaxserve.models import registry
    from jaxserve.models.common import ParamSpec
    from jaxserve.sharding.mesh import serving_mesh
    from jaxserve.sharding.rules import named_shardings

    assert jax.device_count() == 4, jax.devices()
    COMPILE_EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration", "/jax/core/compile/backend_compile_duration")
    compiles, counting = [], [False]

    def on_event(event, duration, **kwargs):
        if counting[0] and event in COMPILE_EVENTS:
            compiles.append(f"{event}: {kwargs.get('fun_name', '?')}")

    jax.monitoring.register_event_duration_secs_listener(on_event)

    class CharTokenizer:  # one character per token id
        eos_token_ids = ()
        vocab_size = 160

        def encode(self, text, add_special_tokens=True):
            return [ord(c) % 160 for c in text]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(320 + int(i)) for i in ids)

    hf = transformers.LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf.architectures = ["LlamaForCausalLM"]
    family, cfg = registry.resolve(hf.to_dict())
    grid = np.array(jax.devices()).reshape(2, 2)
    trainer = Mesh(grid, ("fsdp", "tp"))
    # The same devices in another flat order (jit alone would refuse to combine it with the serving mesh).
    reordered = Mesh(grid.T, ("tp", "fsdp"))

    def trainer_layout(weights, mesh, rules):
        \"\"\"`weights` sharded as a trainer holds them: rules maps logical axes to the trainer's mesh axes.\"\"\"
        def sharding(spec):
            axes = []
            for dim, logical in zip(spec.shape, spec.logical_axes):
                axis = rules.get(logical)
                fits = axis is not None and axis not in axes and dim % mesh.shape[axis] == 0
                axes.append(axis if fits else None)
            return NamedSharding(mesh, PartitionSpec(*axes))
        specs = family.param_specs(cfg)
        return jax.device_put(weights, jax.tree.map(sharding, specs, is_leaf=lambda x: isinstance(x, ParamSpec)))

    # FSDP over the residual dimension, Megatron tensor parallelism over heads, MLP hidden and vocabulary.
    FSDP_TP = dict(embed="fsdp", heads="tp", kv_heads="tp", mlp="tp", vocab="tp")
    # The other way round: the residual dimension over the tensor-parallel axis, the rest over FSDP.
    TRANSPOSED = dict(embed="tp", heads="fsdp", kv_heads="fsdp", mlp="fsdp", vocab="fsdp")
    host = [family.init_weights(cfg, jax.random.key(seed), jnp.float32) for seed in (0, 1, 2)]
    prompts = [np.random.default_rng(5).integers(0, 160, n).tolist() for n in (3, 17, 9)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    references = [generate_dense(family, cfg, w, prompts, 6) for w in host]

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    params = trainer_layout(host[0], trainer, FSDP_TP)
    assert params.layers.wq.sharding.spec == PartitionSpec(None, "fsdp", "tp", None)
    llm = LLM.from_params(
        params, hf.to_dict(), CharTokenizer(), mesh=trainer, mesh_axes={"model": "tp"},
        max_batch_size=4, max_num_tokens=32, max_seq_len=64, attention_backend="xla", show_progress=False,
        compile_config=CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False),
    )
    runner = llm.engine.runner
    serving = named_shardings(family.serving_specs(cfg), runner.mesh)
    layouts = lambda: [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(runner.weights.arrays)]
    expected = [(x.shape, x.dtype, s) for x, s in zip(jax.tree.leaves(runner.weights.arrays), jax.tree.leaves(serving))]
    peers = lambda mesh: [[d.id for d in row] for row in mesh.devices]  # rows: tensor-parallel peers
    results = dict(
        mesh=dict(runner.mesh.shape),
        tp_peers=peers(runner.mesh),
        serving_layout=layouts() == expected,
        wqkv_spec=str(runner.weights.arrays.layers[0].wqkv.sharding.spec),
        wqkv_devices=len(runner.weights.arrays.layers[0].wqkv.sharding.device_set),
        kv_spec=str(runner.kv_cache.k.sharding.spec),
        first=tokens(llm) == references[0],
        tp_first_peers=peers(serving_mesh(Mesh(grid, ("tp", "fsdp")), {"model": "tp"})),
    )
    executables = runner.table.num_executables
    for name, weights, reference in (
        ("same_layout", trainer_layout(host[1], trainer, FSDP_TP), references[1]),
        ("other_layout", trainer_layout(host[2], reordered, TRANSPOSED), references[2]),
    ):
        old = jax.tree.leaves(runner.weights.arrays)
        compiles.clear()
        counting[0] = True
        version = llm.update_weights(weights)
        counting[0] = False
        update_compiles = list(compiles)
        results[name] = dict(
            version=version,
            compiles=update_compiles,
            tokens=tokens(llm) == reference,
            old_freed=all(x.is_deleted() for x in old),
            serving_layout=layouts() == expected,
            executables=runner.table.num_executables == executables,
        )
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def results(run_with_host_devices) -> dict:
    return run_with_host_devices(CHECK, num_devices=4)


def test_the_trainers_mesh_serves_with_its_model_axis_as_tensor_parallel_peers(results: dict):
    assert results["mesh"] == {"data": 2, "model": 2}
    assert results["tp_peers"] == [[0, 1], [2, 3]]  # the trainer's "tp" rows
    assert results["tp_first_peers"] == [[0, 2], [1, 3]]  # a mesh with its "tp" axis first: the grid's columns
    assert results["serving_layout"], "the weights are not in the rules table's layout on the serving mesh"
    assert results["wqkv_spec"] == "P(None, 'model', None, None)" and results["wqkv_devices"] == 4
    assert results["kv_spec"] == "P(None, None, None, 'model', None)"


def test_serving_the_trainers_shards_gives_the_single_device_tokens(results: dict):
    assert results["first"]


def test_an_update_in_the_trainers_layout_compiles_nothing(results: dict):
    update = results["same_layout"]
    assert update["version"] == 1 and update["tokens"], update
    assert update["compiles"] == [], update["compiles"]
    assert update["old_freed"] and update["serving_layout"] and update["executables"], update


def test_an_update_in_another_layout_is_resharded_without_recompiling_the_steps_or_the_fuser(results: dict):
    update = results["other_layout"]
    assert update["version"] == 2 and update["tokens"], update
    # Only the slicing and resharding of a layout not seen before may compile (small, cached by jax).
    for event in update["compiles"]:
        assert not any(name in event for name in ("forward_fn", "sampler_fn", "_serving_layer")), update["compiles"]
    assert update["old_freed"] and update["serving_layout"] and update["executables"], update
