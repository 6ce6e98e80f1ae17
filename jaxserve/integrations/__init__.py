"""Adapters to other frameworks, each importing its framework only when imported itself:
`jaxserve.integrations.tunix` (a rollout engine for google-tunix's RL cluster), `jaxserve.integrations.lm_eval`
(an lm-evaluation-harness model)."""
