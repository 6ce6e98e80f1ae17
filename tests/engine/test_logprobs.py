"""TokenLogprobs against numpy references: one log_softmax gives the chosen token's logprob and rank and the
top-N, for sampled rows and for prompt tokens scored slice by slice."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.logprobs import PROMPT_LOGPROBS_SLICE, no_token_logprobs, prompt_token_logprobs, token_logprobs


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def test_token_logprobs_score_given_tokens_with_their_rank_and_the_top_n():
    rng = np.random.default_rng(15)
    rows, vocab = 20, 40
    logits = rng.normal(0.0, 4.0, size=(rows, vocab)).astype(np.float32)
    tokens = rng.integers(0, vocab, rows)
    out = jax.jit(token_logprobs, static_argnames=("num_top",))(jnp.asarray(logits), jnp.asarray(tokens), num_top=3)
    reference = log_softmax64(logits)
    np.testing.assert_allclose(np.asarray(out.logprob), reference[np.arange(rows), tokens], rtol=1e-5, atol=1e-5)
    chosen = logits[np.arange(rows), tokens][:, None]
    np.testing.assert_array_equal(np.asarray(out.rank), 1 + (logits > chosen).sum(axis=-1))
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-reference, axis=-1)[:, :3])
    np.testing.assert_allclose(
        np.asarray(out.top_logprobs), np.sort(reference, axis=-1)[:, ::-1][:, :3], rtol=1e-5, atol=1e-5
    )
    assert out.rank.dtype == jnp.int32 and out.top_ids.dtype == jnp.int32
    none = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), num_top=0)
    assert none.top_logprobs.shape == (rows, 0) and none.top_ids.shape == (rows, 0)
    np.testing.assert_allclose(np.asarray(none.logprob), np.asarray(out.logprob))


def test_no_token_logprobs_has_the_same_shapes_and_dtypes():
    full = jax.eval_shape(partial(token_logprobs, num_top=4), jnp.zeros((6, 10)), jnp.zeros(6, jnp.int32))
    empty = jax.eval_shape(lambda: no_token_logprobs(6, 4))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), full) == jax.tree.map(lambda a: (a.shape, a.dtype), empty)


def test_prompt_logprobs_over_several_slices_with_missing_targets():
    rng = np.random.default_rng(3)
    num_tokens, dim, vocab = 2 * PROMPT_LOGPROBS_SLICE, 8, 30
    hidden = rng.normal(size=(num_tokens, dim)).astype(np.float32)
    projection = rng.normal(size=(dim, vocab)).astype(np.float32)
    targets = rng.integers(0, vocab, num_tokens)
    targets[::7] = -1  # no next prompt token there

    def compute_logits(h):
        return jnp.einsum("td,dv->tv", h, projection, precision="highest")

    out = jax.jit(partial(prompt_token_logprobs, compute_logits, num_top=2))(jnp.asarray(hidden), jnp.asarray(targets))

    reference = log_softmax64(hidden.astype(np.float64) @ projection)
    valid = targets >= 0
    rows = np.arange(num_tokens)[valid]
    np.testing.assert_allclose(np.asarray(out.logprob)[valid], reference[rows, targets[valid]], atol=1e-4)
    assert (np.asarray(out.logprob)[~valid] == 0).all() and (np.asarray(out.rank)[~valid] == 0).all()
    assert (np.asarray(out.rank)[valid] >= 1).all()
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-reference, axis=-1)[:, :2])
