"""``generate RUN_OR_HOST:PORT --prompt TEXT``: the client of a served model (``hpc_tools serve``)."""

from __future__ import annotations

import argparse

from hpc_tools.cli._common import COUNT, add_json, add_runs_dir, emit_json, real_number, whole_number

NAME = "generate"
ORDER = 63
HELP = "send prompts to a served model (a run served with `serve`, or HOST:PORT of Triton's HTTP endpoint)"
DESCRIPTION = """\
Sends each prompt to the generate model of a Triton server started by `hpc_tools serve` (KServe v2 REST over HTTP)
and prints the generated token ids and text; greedy decoding unless --temperature is above 0. --file sends the
prompts of a JSON-lines file ({"prompt": TEXT} or {"input_ids": [...]}, optional "max_tokens" each) concurrently,
so that Triton's dynamic batcher batches them; answers are printed in the file's order (--json: each with the
number of requests the server decoded it with, batch_size).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("endpoint", metavar="RUN_OR_HOST:PORT", help="a served run (its recorded endpoint) or HOST:PORT")
    p.add_argument("--prompt", default=None, help="prompt text")
    p.add_argument("--ids", default=None, help="prompt as comma-separated token ids (instead of --prompt)")
    p.add_argument("--file", default=None, help="JSON-lines file of prompts, sent as concurrent requests")
    p.add_argument("--max-tokens", type=whole_number(0, what="tokens to generate"), default=32,
                   help="tokens to generate per prompt (default 32)")
    p.add_argument("--temperature", type=real_number(0.0, what="a temperature"), default=0.0,
                   help="0 (default): greedy; above 0: sampling")
    p.add_argument("--concurrency", type=COUNT, default=8, help="requests in flight with --file (default 8)")
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from hpc_tools.errors import UserError
    from hpc_tools.serving import client

    given = [x for x in ("prompt", "ids", "file") if getattr(args, x) is not None]
    if len(given) != 1:
        raise UserError("give exactly one of --prompt TEXT, --ids 1,2,3 or --file prompts.jsonl")
    bodies, shown = [], []
    if args.file:
        path = Path(args.file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise UserError(f"--file {path} cannot be read ({exc.strerror})") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt, ids = item.get("prompt"), item.get("input_ids")
                max_tokens = int(item.get("max_tokens", args.max_tokens))
                if (prompt is None) == (ids is None) or (ids is not None and (not ids or not all(
                        isinstance(t, int) and t >= 0 for t in ids))) or (prompt is not None and not
                                                                          isinstance(prompt, str)):
                    raise ValueError
            except (ValueError, AttributeError, TypeError):
                raise UserError(f"--file {path} line {n} is not a JSON object with a \"prompt\" string or a "
                                f"non-empty \"input_ids\" list of token ids (and an optional \"max_tokens\")") \
                    from None
            bodies.append(client.request_body(prompt, ids, max_tokens, args.temperature))
            shown.append(prompt if prompt is not None else ids)
        if not bodies:
            raise UserError(f"--file {path} holds no prompts")
    elif args.ids is not None:
        try:
            ids = [int(t) for t in args.ids.split(",")]
        except ValueError:
            raise UserError(f"--ids={args.ids} is not a comma-separated list of token ids (e.g. --ids 5,17,3)") \
                from None
        bodies.append(client.request_body(None, ids, args.max_tokens, args.temperature))
        shown.append(ids)
    else:
        bodies.append(client.request_body(args.prompt, None, args.max_tokens, args.temperature))
        shown.append(args.prompt)
    endpoint = client.resolve(args.endpoint, args.runs_dir)
    answers = client.infer_many(endpoint, bodies, args.concurrency)
    results = [{"prompt": p, "output_ids": a["ids"], "text": a["text"], "batch_size": a["batch_size"]}
               for p, a in zip(shown, answers)]
    if args.json:
        emit_json(results[0] if len(results) == 1 and not args.file else {"results": results})
    else:
        for r in results:
            print(f"{json.dumps(r['prompt'])} -> {json.dumps(r['text'])}\n  ids {r['output_ids']}")
    return 0
