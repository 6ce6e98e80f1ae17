"""LoRA adapters served beside the base model, against transformers + peft in float32 (a tiny random Llama, adapters
with non-zero B saved by peft): three adapters of different ranks and target sets mixed with base rows in one
generate, more adapters than slots (the least recently used one is replaced), an update in place that compiles
nothing, the prefix cache keyed by adapter, and the errors a user meets."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import numpy as np
import pytest

peft = pytest.importorskip("peft", reason="peft is in the test extra: pip install -e '.[test]'")

from peft_reference import HF_CONFIG, NEW_TOKENS, VOCAB, peft_tokens, save_adapter, save_base_model  # noqa: E402

from jaxserve.config import CompileConfig, KvCacheConfig  # noqa: E402
from jaxserve.llm import LLM  # noqa: E402
from jaxserve.lora import LoRARequest, LoraSlots  # noqa: E402
from jaxserve.models import lora  # noqa: E402
from jaxserve.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.needs_torch

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# Ranks, alphas and target sets that differ: q/v only; all seven with rsLoRA; k/o/up/down.
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all": dict(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "koud": dict(r=2, lora_alpha=2, target_modules=["k_proj", "o_proj", "up_proj", "down_proj"]),
}
PROMPTS = [np.random.default_rng(i).integers(0, VOCAB, n).tolist() for i, n in enumerate((5, 19, 11, 30, 7, 24))]
# The engine keywords of every LLM here (each adds its buckets and LoRA options); two slots for three adapters: one
# of them waits for a slot.
ENGINE = dict(
    dtype="float32",
    max_batch_size=4,
    max_num_tokens=32,
    max_seq_len=128,
    kv_cache_config=KvCacheConfig(max_tokens=512),
    attention_backend="xla",
    max_loras=2,
    show_progress=False,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The base model and the adapters on disk (a second 'qv' for updates), and peft's tokens for each."""
    root = tmp_path_factory.mktemp("lora")
    base = save_base_model(root / "base")
    for seed, (name, options) in enumerate(ADAPTERS.items(), start=1):
        save_adapter(base, root / name, seed, **options)
    save_adapter(base, root / "qv2", 10, **ADAPTERS["qv"])
    expected = {name: peft_tokens(root / "base", root / name, PROMPTS) for name in [*ADAPTERS, "qv2"]}
    expected[None] = peft_tokens(root / "base", None, PROMPTS)
    return root, expected


@pytest.fixture(scope="module")
def llm(saved, char_tokenizer):
    root, _ = saved
    llm = LLM(
        str(root / "base"),
        tokenizer=char_tokenizer(),
        compile_config=CompileConfig(decode_batch_sizes=(2, 4), token_buckets=(16, 32), penalty_variants=False),
        enable_lora=True,
        max_lora_rank=8,
        **ENGINE,
    )
    yield llm
    llm.close()


def _request(root, name: str, index: int) -> LoRARequest:
    return LoRARequest(name, index, str(root / name))


def test_adapters_differ_from_the_base_model(saved):
    _, expected = saved
    for name in ADAPTERS:
        assert expected[name] != expected[None], f"adapter {name} does not move the greedy tokens: a weak test"


def test_three_adapters_mixed_with_base_rows_give_peft_tokens(saved, llm):
    root, expected = saved
    names = [None, "qv", "all", "koud", "qv", None]
    requests = [None if n is None else _request(root, n, 1 + list(ADAPTERS).index(n)) for n in names]
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=requests)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == [expected[n][i] for i, n in enumerate(names)]
    assert sorted(llm.list_loras()) == sorted(ADAPTERS)
    # Two slots for three adapters: the least recently used one was replaced while the others waited.
    slots = llm.engine.scheduler.lora_slots
    assert len(slots.holder) == 2 and not any(slots.pins.values())


def test_one_adapter_for_every_prompt_and_stream(saved, llm):
    root, expected = saved
    request = _request(root, "all", 2)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False, lora_request=request)]
    assert got == expected["all"][:3]
    *_, last = llm.stream(PROMPTS[3], GREEDY, lora_request=request)
    assert last.outputs[0].token_ids == expected["all"][3]


def test_load_update_and_unload_compile_nothing(saved, llm, record_compiles):
    root, expected = saved
    request = LoRARequest("qv", 1)
    llm.load_lora("qv", str(root / "qv")) if "qv" not in llm.list_loras() else None
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=request)] == (
        expected["qv"]
    )
    with record_compiles() as compiled:
        llm.update_lora("qv", str(root / "qv2"))
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=request)]
        llm.load_lora("koud-again", str(root / "koud"))  # another rank, loaded, served and unloaded
        again = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("koud-again", 50))
        llm.unload_lora("koud-again")
    assert got == expected["qv2"]
    assert again[0].outputs[0].token_ids == expected["koud"][0]
    assert not compiled, f"loading, updating or unloading an adapter, or a generate after, compiled: {compiled}"
    llm.update_lora("qv", str(root / "qv"))  # back, for the other tests


def test_prefix_cached_under_one_adapter_is_not_a_hit_for_another(saved, llm):
    root, expected = saved
    prompt = np.random.default_rng(7).integers(0, VOCAB, 40).tolist()  # two full blocks of 16
    stats = llm.engine.block_manager.stats

    def run(name):
        request = None if name is None else _request(root, name, 1 + list(ADAPTERS).index(name))
        before = stats.hit_tokens
        tokens = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=request)[0].outputs[0].token_ids
        return tokens, stats.hit_tokens - before

    first, hits = run("qv")
    assert run("qv") == (first, 32)  # the same adapter reuses its two blocks
    for other in ("all", None):
        assert run(other)[1] == 0, f"{other} reused a block computed under qv"
    # An update: the adapter's old blocks are not reused either.
    llm.update_lora("qv", str(root / "qv2"))
    try:
        assert run("qv")[1] == 0
    finally:
        llm.update_lora("qv", str(root / "qv"))


def test_no_compiled_forward_copies_an_adapter_table(llm):
    """Every step reads the tables as they are stored: x @ a is one GEMM over the table's columns (a [*in, S, P*R],
    here folded into the weights: [*in, N + S*P*R]), with no copy or transpose of a table or a folded weight into
    another layout on every step (a [S, *in, P*R] made XLA copy it)."""
    import itertools

    weights = llm.engine.runner.weights
    folded = [w.values for layer in weights.arrays.layers for w in vars_of(layer) if isinstance(w, lora.FoldedWeight)]
    assert folded, "one device, unquantized weights: the tables' a should be folded into the weights"
    tables = jax.tree.leaves(weights.lora) + folded
    shapes = {",".join(map(str, p)) for t in tables for p in itertools.permutations(t.shape) if p != t.shape}
    shapes |= {",".join(map(str, t.shape)) for t in tables}
    moved = re.compile(r"= \w+\[([0-9,]+)\]\S* (?:copy|transpose)\(")
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)  # compiles the steps it takes (the table is lazy)
    forwards = llm.engine.runner.table.forwards
    assert forwards
    for (bucket, _), forward in forwards.items():
        copied = [m.group(1) for m in map(moved.search, forward.as_text().splitlines()) if m]
        assert not shapes & set(copied), f"T={bucket.num_tokens} copies an adapter table: {shapes & set(copied)}"


def vars_of(layer) -> list:
    return [getattr(layer, f.name) for f in dataclasses.fields(layer)]


def test_folded_adapters_survive_sleep_and_weight_updates(saved, llm):
    """With the tables' a folded into the weights, the adapters outlive every way the weights are replaced or moved:
    an update in place, sleep(1) and wake_up, an update while asleep at level 1 (the a columns of the host copy),
    sleep(2) and an update (the a columns kept apart while no weights exist)."""
    from safetensors.numpy import load_file

    root, expected = saved
    base = load_file(str(root / "base" / "model.safetensors"))
    request = _request(root, "all", 2)

    def tokens():
        outputs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[request, None])
        return [o.outputs[0].token_ids for o in outputs]

    want = [expected["all"][0], expected[None][1]]
    assert tokens() == want
    llm.update_weights(base)
    assert tokens() == want, "after update_weights"
    llm.sleep(1)
    llm.wake_up()
    assert tokens() == want, "after sleep(1)"
    llm.sleep(1)
    llm.update_weights(base)
    llm.wake_up()
    assert tokens() == want, "after an update while asleep at level 1"
    llm.sleep(2)
    llm.update_weights(base)
    llm.wake_up()
    assert tokens() == want, "after sleep(2) and an update"


def _tensors_and_config(directory) -> tuple[dict, dict]:
    from safetensors.numpy import load_file

    return load_file(str(directory / "adapter_model.safetensors")), json.loads(
        (directory / "adapter_config.json").read_text()
    )


def _tunix_tree(base_dir) -> dict:
    """The base model's weights as a tunix Llama3's parameters (nested as an NNX pure dict, layer indices as int
    keys): our layouts under tunix's names."""
    from safetensors.numpy import load_file

    hf = load_file(str(base_dir / "model.safetensors"))
    d, h, k = HF_CONFIG["hidden_size"], HF_CONFIG["num_attention_heads"], HF_CONFIG["num_key_value_heads"]
    dh = d // h
    layers = {}
    for i in range(HF_CONFIG["num_hidden_layers"]):
        w = {name.removeprefix(f"model.layers.{i}."): v for name, v in hf.items() if f"layers.{i}." in name}
        layers[i] = {
            "input_layernorm": {"w": w["input_layernorm.weight"]},
            "post_attention_layernorm": {"w": w["post_attention_layernorm.weight"]},
            "attn": {
                "q_proj": {"w": w["self_attn.q_proj.weight"].T.reshape(d, h, dh)},
                "k_proj": {"w": w["self_attn.k_proj.weight"].T.reshape(d, k, dh)},
                "v_proj": {"w": w["self_attn.v_proj.weight"].T.reshape(d, k, dh)},
                "o_proj": {"w": w["self_attn.o_proj.weight"].T.reshape(h, dh, d)},
            },
            "mlp": {m: {"kernel": w[f"mlp.{m}.weight"].T} for m in ("gate_proj", "up_proj", "down_proj")},
        }
    return {
        "embedder": {"input_embedding": hf["model.embed_tokens.weight"]},
        "final_norm": {"w": hf["model.norm.weight"]},
        "lm_head": {"w": hf["lm_head.weight"].T},
        "layers": layers,
    }


def _qwix_lora(adapter_dir) -> tuple[dict, float]:
    """A PEFT adapter as qwix's LoRA parameters of a tunix Llama3 (`w_lora_a` [*in, r], `w_lora_b` [r, *out];
    `kernel_lora_*` on the MLP), nested as `_tunix_tree`, and the qwix alpha (scaling alpha / r) that matches it."""
    tensors, config = _tensors_and_config(adapter_dir)
    r = config["r"]
    scaling = config["lora_alpha"] / (r**0.5 if config.get("use_rslora") else r)
    d, h, k = HF_CONFIG["hidden_size"], HF_CONFIG["num_attention_heads"], HF_CONFIG["num_key_value_heads"]
    dh = d // h
    in_shape = {"q_proj": (d,), "k_proj": (d,), "v_proj": (d,), "o_proj": (h, dh)}
    out_shape = {"q_proj": (h, dh), "k_proj": (k, dh), "v_proj": (k, dh), "o_proj": (d,)}
    layers: dict = {}
    for name, value in tensors.items():
        match = re.search(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight", name)
        layer, block, module, half = int(match.group(1)), match.group(2), match.group(3), match.group(4)
        if half == "A":  # [r, in] -> [*in, r]
            leaf = value.T.reshape(*in_shape.get(module, (-1,)), r)
        else:  # [out, r] -> [r, *out]
            leaf = value.T.reshape(r, *out_shape.get(module, (-1,)))
        attention = block == "self_attn"  # tunix's attention weights are `w`, its MLP's `kernel`
        node = layers.setdefault(layer, {}).setdefault("attn" if attention else "mlp", {})
        node.setdefault(module, {})[f"{'w' if attention else 'kernel'}_lora_{half.lower()}"] = leaf
    return {"layers": layers}, scaling * r


def _merged(tree: dict, extra: dict) -> dict:
    out = dict(tree)
    for key, value in extra.items():
        out[key] = _merged(tree[key], value) if isinstance(value, dict) and key in tree else value
    return out


def test_tunix_tree_with_qwix_lora_through_from_params_gives_peft_tokens(saved, char_tokenizer):
    """A tunix Llama3 trained with qwix LoRA, given to `from_params` as it is: its LoRA parameters are served as an
    adapter beside the base model, and two more qwix trees load beside it; mixed with base rows, each gives peft's
    tokens."""
    root, expected = saved
    lora_all, alpha_all = _qwix_lora(root / "all")
    config = json.loads((root / "base" / "config.json").read_text())
    with pytest.raises(ValueError, match="pass lora_alpha"):
        LLM.from_params(_merged(_tunix_tree(root / "base"), lora_all), config, char_tokenizer())
    with pytest.raises(ValueError, match="rank 8 is above max_lora_rank=4"):
        LLM.from_params(_merged(_tunix_tree(root / "base"), lora_all), config, None, lora_alpha=1.0, max_lora_rank=4)
    with pytest.raises(ValueError, match="hold no qwix LoRA parameters"):
        LLM.from_params(_tunix_tree(root / "base"), config, char_tokenizer(), lora_alpha=1.0)
    llm = LLM.from_params(
        _merged(_tunix_tree(root / "base"), lora_all),
        config,
        char_tokenizer(),
        lora_alpha=alpha_all,
        lora_name="all",
        compile_config=CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False),
        **ENGINE,
    )
    with llm:
        assert llm.list_loras() == ["all"] and llm.config.lora.max_lora_rank == ADAPTERS["all"]["r"]
        for name in ("qv", "koud"):
            tree, alpha = _qwix_lora(root / name)
            llm.load_lora(name, tree, {"lora_alpha": alpha})
        names = [None, "qv", "all", "koud", "all", None]
        ids = {"all": 1, "qv": 2, "koud": 3}
        requests = [None if n is None else LoRARequest(n, ids[n]) for n in names]
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=requests)
        assert [o.outputs[0].token_ids for o in outputs] == [expected[n][i] for i, n in enumerate(names)]


def test_gemma_qwix_einsums_give_each_projection_its_pair():
    """A tunix Gemma's qwix LoRA on its einsum weights: kv_einsum's (and qkv_einsum's) one A serves each projection
    it holds, with that projection's slice of B; attn_vec_einsum's A is [H, Dh, r]. Against tunix's own forward:
    tests/integrations/test_tunix_gemma.py."""
    from jaxserve.lora import from_qwix

    rng = np.random.default_rng(0)
    d, h, k, dh, r = 8, 4, 2, 3, 2

    def normal(*shape):
        return rng.standard_normal(shape, np.float32)

    a_q, b_q = normal(d, r), normal(r, h, dh)
    a_kv, b_kv = normal(d, r), normal(r, 2, k, dh)
    a_o, b_o = normal(h, dh, r), normal(r, d)
    tree = {
        "layers.0.attn.q_einsum.w_lora_a": a_q,
        "layers.0.attn.q_einsum.w_lora_b": b_q,
        "layers.0.attn.kv_einsum.w_lora_a": a_kv,
        "layers.0.attn.kv_einsum.w_lora_b": b_kv,
        "layers.0.attn.attn_vec_einsum.w_lora_a": a_o,
        "layers.0.attn.attn_vec_einsum.w_lora_b": b_o,
    }
    adapter = from_qwix("g", tree, {"lora_alpha": 4.0})
    assert adapter.rank == r and adapter.scaling == 2.0
    pairs = adapter.weights  # qwix's layout kept: A [in, r], B [r, out]
    assert adapter.transposed and adapter.peft_shapes()[(0, "o_proj")] == ((r, h * dh), (d, r))
    np.testing.assert_array_equal(pairs[(0, "q_proj")][1], b_q.reshape(r, h * dh))
    for i, module in enumerate(("k_proj", "v_proj")):
        np.testing.assert_array_equal(pairs[(0, module)][0], a_kv)
        np.testing.assert_array_equal(pairs[(0, module)][1], b_kv[:, i].reshape(r, k * dh))
    np.testing.assert_array_equal(pairs[(0, "o_proj")][0], a_o.reshape(h * dh, r))
    bad = {**tree, "layers.0.attn.kv_einsum.w_lora_b": normal(r, 3, k, dh)}
    with pytest.raises(ValueError, match="layer 0 kv_einsum"):
        from_qwix("g", bad, {"lora_alpha": 4.0})
    both = {**tree, "layers.0.attn.qkv_einsum.w_lora_a": a_kv, "layers.0.attn.qkv_einsum.w_lora_b": normal(r, 3, h, dh)}
    with pytest.raises(ValueError, match="two qwix parameters of layer 0 hold"):
        from_qwix("g", both, {"lora_alpha": 4.0})


def test_errors_name_the_problem_and_change_nothing(saved, llm, tmp_path):
    root, expected = saved
    tensors, config = _tensors_and_config(root / "all")
    before = llm.list_loras()
    with pytest.raises(ValueError, match="rank 16 is above max_lora_rank 8"):
        wide = {k: np.concatenate([v, v], 0 if "lora_A" in k else 1) for k, v in tensors.items()}
        llm.load_lora("too-wide", wide, {**config, "r": 16})
    with pytest.raises(ValueError, match="layer 5 q_proj: a layer the model lacks"):
        extra = {k.replace("layers.1.", "layers.5."): v for k, v in tensors.items() if "layers.1.self_attn.q_proj" in k}
        llm.load_lora("deep", {**tensors, **extra}, config)
    with pytest.raises(ValueError, match="lm_head.lora_A.weight is not a lora_A / lora_B weight"):
        head = {"base_model.model.lm_head.lora_A.weight": np.zeros((8, 64), np.float32)}
        llm.load_lora("head", {**tensors, **head}, config)
    with pytest.raises(ValueError, match="another base model"):
        narrow = {k: v[:, :32] if "lora_A" in k else v for k, v in tensors.items()}
        llm.load_lora("narrow", narrow, config)
    with pytest.raises(ValueError, match="DoRA"):
        llm.load_lora("dora", tensors, {**config, "use_dora": True})
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nobody'"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("nobody", 99))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.load_lora("empty", str(tmp_path))
    with pytest.raises(ValueError, match="already loaded"):
        llm.load_lora("all", str(root / "all"))
    assert llm.list_loras() == before
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
    assert got == expected[None][:2]


def test_an_engine_without_lora_refuses_adapters(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"))
    try:
        with pytest.raises(ValueError, match="enable_lora=True"):
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, "/nowhere"))
    finally:
        llm.close()


def test_slots_hand_out_free_then_least_recently_used_unpinned_slots():
    slots = LoraSlots(max_loras=2)
    assert slots.acquire("a") == 1 and slots.acquire("b") == 2
    assert slots.pending == {1: "a", 2: "b"}
    slots.pending.clear()
    assert slots.acquire("c") is None  # both pinned
    slots.release("a")
    assert slots.acquire("a") == 1 and not slots.pending  # still resident: no write
    slots.release("a")
    slots.release("b")
    assert slots.acquire("c") == 2  # b is the least recently used
    assert slots.pending == {2: "c"} and slots.slot_of("b") is None
    with pytest.raises(RuntimeError, match="in use"):
        slots.forget("c")
    slots.release("c")
    assert slots.forget("c") == 2 and slots.slot_of("c") is None


def test_tensors_in_memory_equal_the_directory(saved, llm):
    root, expected = saved
    tensors, config = _tensors_and_config(root / "koud")
    llm.load_lora("koud-memory", tensors, config)
    try:
        got = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=LoRARequest("koud-memory", 40))
        assert [o.outputs[0].token_ids for o in got] == expected["koud"][:2]
    finally:
        llm.unload_lora("koud-memory")
    assert "koud-memory" not in llm.list_loras()


def test_lora_request_checks_its_fields():
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0)
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1)


def test_the_bench_spreads_requests_over_random_adapters_and_times_an_update(llm):
    from jaxserve import bench, workload

    adapters = bench.random_adapters(llm, 2, seed=3, first_id=100)  # ids 1, 2 name this module's adapters
    try:
        assert [a.lora_name for a in adapters] == ["random-0", "random-1"]
        job = workload.random_workload(4, 6, 3, VOCAB, seed=0)
        run = bench.timed_generate(llm, job, workload.SamplingOptions(0.0, 1.0, None, None), adapters=adapters)
        assert run.output_tokens == 12
        closed = bench.timed_generate(llm, job, workload.SamplingOptions(0.0, 1.0, None, None), 2, adapters)
        assert [o.outputs[0].token_ids for o in closed.outputs] == [o.outputs[0].token_ids for o in run.outputs]
        summary = bench.lora_summary(llm, adapters, seed=0)
        assert (summary.adapters, summary.rank) == (2, 8)
        assert summary.update_ms > 0 and summary.update_device_bf16_ms > 0
    finally:
        for adapter in adapters:
            llm.unload_lora(adapter.lora_name)
