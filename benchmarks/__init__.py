"""Load generator for OpenAI-compatible servers, measured the way ``vllm bench serve`` does.

Modules, one concern each:

- ``datasets``: turn a dataset choice (random / sharegpt / structured) into ``BenchRequest``s.
- ``arrivals``: when each request is sent (Poisson / gamma open loop, or all at once).
- ``client``: one streamed HTTP request -> one ``RequestOutcome`` (TTFT, ITLs, E2E, token counts).
- ``records``: the per-request record shared by client, metrics and result files.
- ``metrics``: pure summary math (throughput, TTFT/TPOT/ITL/E2E percentiles, goodput).
- ``serve``: the runner behind ``bench serve``: schedule, collect, print the table, write JSON.
- ``plot``: latency CDFs and throughput-vs-concurrency PNGs from result files.
- ``cli``: ``add_bench_parser`` (the ``bench`` command and its subcommands) and ``main``.
"""
