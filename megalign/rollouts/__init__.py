"""Rollout files: what an inference engine wrote of the tokens it generated and their logprobs, read by
both sides (a run's tokens and loss mask, compare's logprobs). Below run/ and compare/: it imports only
megalign.errors."""
