"""The HTTP face of shardserve: Ray Serve ingress deployments speaking OpenAI's API.

Owns everything textual: auth, validation, chat templates, tokenization, detokenization, stop
strings, tool-call and reasoning parsing, SSE. Sends token ids to replicas/ and gets token ids back."""
