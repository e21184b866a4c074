"""Test doubles shared by the tests and the benchmarks: a scripted, deterministic generation engine and the small
tokenizers it speaks (:mod:`arpo.testing.scripted_engine`). Nothing in the training or rollout code imports this."""
