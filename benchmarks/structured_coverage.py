"""JSON-schema coverage of structured/ on JSONSchemaBench: compile, then judge every test instance.

For each schema: check and compile it (structured.schema_check + structured.compiler, with the time
limit), then feed every test instance token by token through a guide exactly as the engine would:
fill the bitmask row, check the token's bit, advance; at the end the output must be complete (EOS
allowed). An instance is accepted when every token was allowed and the end was complete. Instances
are serialized with json.dumps(separators=(",", ":")), so non-ASCII characters come as \\u escapes;
--utf8 writes them as UTF-8, as a model usually does.

Outcomes per schema:
  pass      compiled, every valid instance accepted and every invalid one rejected
  rejected  refused with a 400 (unsupported keyword, invalid schema, ...): a clear answer, not a
            mis-judgment
  timeout   took longer than --timeout to compile (also a 400 to a client)
  misjudged compiled but judged an instance wrong: `unsound` when it accepted an invalid instance
            (the worst case), `strict` when it refused a valid one

Also reported: compile time p50/p99 (ms, wall time of `await compile`) and mask time per token
p50/p99 (µs, `fill_bitmask`).

    python -m benchmarks.structured_coverage [--limit N] [--timeout S] [--json-out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_DATA = Path("/work/shared/jsonschemabench")
DEFAULT_TOKENIZER = Path(__file__).resolve().parents[1] / "replicas" / "embedded" / "tokenizer.json"
EOS_NAMES = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<|end_of_text|>")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def judge_instance(guide, mask, token_ids: list[int], mask_times: list[float]) -> bool:
    """Feed the tokens through the guide as the engine would; True when the output is accepted."""
    for t in token_ids:
        started = time.perf_counter()
        guide.fill_bitmask(mask, 0)
        mask_times.append(time.perf_counter() - started)
        if not (int(mask[0, t >> 5]) >> (t & 31)) & 1:
            return False
        guide.advance(t)
    guide.fill_bitmask(mask, 0)
    eos = guide.vocab.eos_token_id
    return guide.is_finished() and bool((int(mask[0, eos >> 5]) >> (eos & 31)) & 1)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenizers import Tokenizer

    from structured import bitmask
    from structured.compiler import Compiler
    from structured.errors import ConstraintError
    from structured.spec import Constraint
    from structured.vocabulary import Vocabulary

    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    eos = [i for i in (tokenizer.token_to_id(n) for n in EOS_NAMES) if i is not None]
    if not eos:
        raise SystemExit(f"no EOS token among {EOS_NAMES} in {args.tokenizer}")
    vocab = Vocabulary.from_tokenizer(tokenizer, eos)
    compiler = Compiler(vocab, timeout_s=args.timeout, cache_size=16, processes=1)
    compiler.start()
    mask = bitmask.allocate(1, vocab.size)

    files = sorted(Path(args.data).glob("*.json"))
    if args.limit:
        files = files[:args.limit]
    records: list[dict[str, Any]] = []
    compile_times: list[float] = []
    mask_times: list[float] = []
    try:
        for path in files:
            data = json.loads(path.read_text())
            record: dict[str, Any] = {"file": path.name, "category": path.name.split("---")[0]}
            spec = Constraint("json_schema", json.dumps(data["schema"]))
            started = time.perf_counter()
            try:
                compiled = await compiler.compile(spec)
            except ConstraintError as e:
                record["outcome"] = "timeout" if "took longer" in e.message else "rejected"
                record["reason"] = e.message
                records.append(record)
                continue
            compile_times.append(time.perf_counter() - started)
            wrong = []
            for test in data["tests"]:
                text = json.dumps(test["data"], separators=(",", ":"), ensure_ascii=not args.utf8)
                ids = tokenizer.encode(text, add_special_tokens=False).ids
                accepted = judge_instance(compiled.new_guide(), mask, ids, mask_times)
                if accepted != test["valid"]:
                    wrong.append({"valid": test["valid"], "instance": text[:300]})
            record["instances"] = len(data["tests"])
            if not wrong:
                record["outcome"] = "pass"
            else:
                record["outcome"] = "misjudged"
                record["unsound"] = any(not w["valid"] for w in wrong)
                record["wrong"] = wrong
            records.append(record)
            if args.verbose:
                print(f"{path.name}: {record['outcome']}", file=sys.stderr)
    finally:
        compiler.close()
    return summarize(records, compile_times, mask_times, args)


def summarize(records, compile_times, mask_times, args) -> dict[str, Any]:
    outcomes = collections.Counter(r["outcome"] for r in records)
    total = len(records)
    reasons = collections.Counter(r["reason"].splitlines()[0][:100] for r in records
                                  if r["outcome"] in ("rejected", "timeout"))
    by_category: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in records:
        by_category[r["category"]][r["outcome"]] += 1
    return {
        "schemas": total,
        "pass": outcomes["pass"],
        "pass_rate": outcomes["pass"] / total if total else 0.0,
        "rejected_400": outcomes["rejected"],
        "timeout": outcomes["timeout"],
        "misjudged": outcomes["misjudged"],
        "misjudged_unsound": sum(1 for r in records if r.get("unsound")),
        "instances_judged": sum(r.get("instances", 0) for r in records),
        "compile_ms_p50": percentile(compile_times, 50) * 1e3,
        "compile_ms_p99": percentile(compile_times, 99) * 1e3,
        "mask_us_p50": percentile(mask_times, 50) * 1e6,
        "mask_us_p99": percentile(mask_times, 99) * 1e6,
        "mask_us_mean": (statistics.fmean(mask_times) * 1e6) if mask_times else float("nan"),
        "tokens_masked": len(mask_times),
        "timeout_s": args.timeout,
        "by_category": {k: dict(v) for k, v in sorted(by_category.items())},
        "top_rejections": reasons.most_common(15),
        "records": records,
    }


def print_report(s: dict[str, Any]) -> None:
    print(f"schemas            {s['schemas']}")
    print(f"pass               {s['pass']} ({100 * s['pass_rate']:.1f}%)")
    print(f"rejected (400)     {s['rejected_400']}")
    print(f"timeout            {s['timeout']} (limit {s['timeout_s']:g} s)")
    print(f"misjudged          {s['misjudged']} (accepted an invalid instance: "
          f"{s['misjudged_unsound']})")
    print(f"instances judged   {s['instances_judged']}")
    print(f"compile ms         p50 {s['compile_ms_p50']:.2f}  p99 {s['compile_ms_p99']:.2f}")
    print(f"mask µs / token    p50 {s['mask_us_p50']:.1f}  p99 {s['mask_us_p99']:.1f}  "
          f"mean {s['mask_us_mean']:.1f}  ({s['tokens_masked']} tokens)")
    print("by category        " + "; ".join(
        f"{k}: {v.get('pass', 0)}/{sum(v.values())}" for k, v in s["by_category"].items()))
    print("top 400 reasons:")
    for reason, count in s["top_rejections"]:
        print(f"  {count:4d}  {reason}")
    for r in s["records"]:
        if r["outcome"] == "misjudged":
            print(f"MISJUDGED {r['file']}: {json.dumps(r['wrong'][:2], ensure_ascii=False)[:400]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="JSONSchemaBench folder")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER, help="tokenizer.json")
    parser.add_argument("--limit", type=int, default=0, help="only the first N schemas (0: all)")
    parser.add_argument("--timeout", type=float, default=10.0, help="compile time limit, seconds")
    parser.add_argument("--utf8", action="store_true",
                        help="serialize instances as UTF-8 (ensure_ascii=False) instead of json.dumps's "
                             "default \\u escapes")
    parser.add_argument("--json-out", type=Path, help="write the summary and per-schema records here")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    summary = asyncio.run(run(args))
    print_report(summary)
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
