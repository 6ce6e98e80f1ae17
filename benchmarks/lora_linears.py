"""The cost of LoRA's products at decode sizes, per way of computing them: a chain of the 8B shape's linear layers
(32 layers of wqkv, wo, w_gate_up, w_down with the residual adds and silu(gate) x up between them, no attention),
timed as one jitted call per variant, rows x layers as a decode step runs them.

    python benchmarks/lora_linears.py                       # GPU: rows 1 and 8, 4 rank-16 slots + slot 0
    python benchmarks/lora_linears.py --shape tiny --layers 2 --calls 2   # CPU check of every variant

Variants (each adds every linear's adapters' share for each row's slot, as `jaxserve.models.lora` lays out the
tables: a [K, S*P*R], b [S*P*R, N]; the rows take slots 1..S-1 in turn):
- base: the linears alone.
- xla: `lora_delta` as the engine runs it (x @ a, the slot mask, @ b; XLA's products).
- splitk: x @ a split over K by hand (a batched product of K/256-wide pieces, then their sum), the rest XLA's.
- shrink: the Pallas shrink kernel for x @ a (`jaxserve.kernels.lora.lora_shrink`), the rest XLA's.
- fold: a stored beside the base weight as extra output columns ([K, N + S*P*R]): one GEMM gives x @ w and x @ a,
  then the mask and @ b (what a fold of the tables into the weights would run).
Every variant's output is compared with xla's (same products, so the same values up to the GEMMs' order; base's
difference shows the adapters' share).
Prints wall ms per call, the added ms against base, and base / variant (the step's share, if the linears were the
whole step).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.lora import lora_shrink

SHAPES = {"llama8b": (4096, 6144, 14336), "tiny": (256, 384, 512)}  # D, q+k+v width, F
MODULES = {"wqkv": 3, "wo": 1, "w_gate_up": 2, "w_down": 1}  # P: the modules each linear holds


def make(shape: str, layers: int, slots: int, rank: int, dtype: jnp.dtype) -> list[dict[str, tuple]]:
    dim, qkv, ffn = SHAPES[shape]
    dims = {"wqkv": (dim, qkv), "wo": (dim, dim), "w_gate_up": (dim, 2 * ffn), "w_down": (ffn, dim)}
    key = jax.random.key(0)
    out = []
    for _ in range(layers):
        layer = {}
        for name, (k, n) in dims.items():
            key, kw, ka, kb = jax.random.split(key, 4)
            cols = slots * MODULES[name] * rank
            # Scaled so that 32 residual adds stay finite in bf16 (the diff column compares the variants).
            w = (jax.random.normal(kw, (k, n), jnp.float32) * (0.1 / np.sqrt(k))).astype(dtype)
            a = (jax.random.normal(ka, (k, cols), jnp.float32) / np.sqrt(k)).astype(dtype)
            b = (jax.random.normal(kb, (cols, n), jnp.float32) * 0.02).astype(dtype)
            layer[name] = (w, a, b)
        out.append(layer)
    return out


def shrink_xla(x, a):
    return jnp.dot(x, a, preferred_element_type=x.dtype)


def shrink_splitk(x, a, piece: int = 256):
    k = x.shape[1]
    splits = max(1, k // piece)
    xs = x.reshape(x.shape[0], splits, k // splits)
    parts = jnp.einsum("msk,skc->smc", xs, a.reshape(splits, k // splits, -1), preferred_element_type=jnp.float32)
    return parts.sum(0).astype(x.dtype)


def shrink_pallas(x, a):
    return lora_shrink(x, a, interpret=jax.default_backend() == "cpu").astype(x.dtype)


def expand(xa, b, mask):
    return jnp.dot((xa * mask).astype(b.dtype), b, preferred_element_type=xa.dtype)


def forward(variant: str, layers, x, masks):
    """The chain: h -> qkv -> (its first D columns as the attention's output) -> wo -> +h -> gate_up -> act -> down."""

    def lin(name, inp, w, a, b):
        if variant == "base":
            return inp @ w
        if variant == "fold":
            both = inp @ w  # w is [K, N + cols] here
            n = both.shape[1] - a.shape[1]
            return both[:, :n] + expand(both[:, n:], b, masks[name])
        xa = {"xla": shrink_xla, "splitk": shrink_splitk, "shrink": shrink_pallas}[variant](inp, a)
        return inp @ w + expand(xa, b, masks[name])

    h = x
    dim = x.shape[1]
    for layer in layers:
        qkv = lin("wqkv", h, *layer["wqkv"])
        h = h + lin("wo", qkv[:, :dim], *layer["wo"])
        gu = lin("w_gate_up", h, *layer["w_gate_up"])
        ffn = gu.shape[1] // 2
        h = h + lin("w_down", jax.nn.silu(gu[:, :ffn]) * gu[:, ffn:], *layer["w_down"])
    return h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--variants", default="base,xla,splitk,shrink,fold")
    args = parser.parse_args()
    slots = args.adapters + 1
    variants = args.variants.split(",")
    layers = make(args.shape, args.layers, slots, args.rank, jnp.bfloat16)
    folded = [{n: (jnp.concatenate([w, a], axis=1), a, b) for n, (w, a, b) in layer.items()} for layer in layers]
    print(
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {args.shape}, {args.layers} layers, "
        f"{args.adapters} adapters of rank {args.rank} (S = {slots})"
    )
    print("| rows | variant | ms a call | added ms | base / variant | max diff to xla |")
    print("|---:|---|---:|---:|---:|---:|")
    for rows in [int(r) for r in args.rows.split(",")]:
        dim = SHAPES[args.shape][0]
        x = (jax.random.normal(jax.random.key(1), (rows, dim), jnp.float32)).astype(jnp.bfloat16)
        row_slots = 1 + np.arange(rows) % args.adapters
        masks = {}
        for name, p in MODULES.items():
            cols = p * args.rank
            keep = (np.arange(slots * cols)[None, :] // cols) == row_slots[:, None]
            masks[name] = jnp.asarray(keep, jnp.bfloat16)
        results, times = {}, {}
        for variant in variants:
            fn = jax.jit(lambda ls, x, masks, v=variant: forward(v, ls, x, masks))
            ls = folded if variant == "fold" else layers
            out = jax.block_until_ready(fn(ls, x, masks))
            for _ in range(3):
                jax.block_until_ready(fn(ls, x, masks))
            start = time.perf_counter()
            for _ in range(args.calls):
                out = fn(ls, x, masks)
            jax.block_until_ready(out)
            times[variant] = (time.perf_counter() - start) / args.calls * 1e3
            results[variant] = np.asarray(out.astype(jnp.float32))
        for variant in variants:
            ms = times[variant]
            base = times.get("base", float("nan"))
            ref = results.get("xla")
            diff = float(np.max(np.abs(results[variant] - ref))) if ref is not None else 0.0
            print(f"| {rows} | {variant} | {ms:.3f} | {ms - base:+.3f} | {base / ms:.1%} | {diff:.3g} |")


if __name__ == "__main__":
    main()
