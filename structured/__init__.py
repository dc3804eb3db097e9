"""Structured outputs: constraint specs compiled (with outlines-core / llguidance) into guides that
mask logits token by token. Knows token ids and a vocabulary, never the engine (no replicas import)."""
