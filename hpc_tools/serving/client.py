"""The ``generate`` model's client: KServe v2 REST (``POST /v2/models/generate/infer``, JSON) with the standard library
only, so the training environment needs no Triton client. A run reference resolves to the endpoint its serving job
recorded; ``HOST:PORT`` names Triton's HTTP port directly."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hpc_tools.errors import UserError

MODEL = "generate"
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


@dataclass(frozen=True)
class Endpoint:
    host: str
    http_port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}/v2/models/{MODEL}/infer"


def resolve(ref: str, runs_dir: str | None = None) -> Endpoint:
    """``HOST:PORT``, or a run whose serving job is ready (its manifest's endpoint)."""
    m = _HOST_PORT.match(ref)
    if m and not _looks_like_run(ref, runs_dir):
        return Endpoint(m[1], int(m[2]))
    from hpc_tools.registry import resolve_run
    from hpc_tools.serving.job import refresh

    run = resolve_run(ref, runs_dir)
    record = refresh(run)
    endpoint = run.manifest().get("endpoint")
    if not endpoint or not record or record.get("state") != "RUNNING":
        state = (record or {}).get("state", "never served")
        raise UserError(f"run {run.run_id} has no serving endpoint ({state}): start one with "
                        f"`python -m hpc_tools serve {run.run_id}`")
    if record.get("engine") == "vllm":
        raise UserError(f"run {run.run_id} is served by vLLM's OpenAI server at http://{endpoint['host']}:"
                        f"{endpoint['http_port']}/v1 (use an OpenAI client; generate speaks to Triton)")
    return Endpoint(endpoint["host"], int(endpoint["http_port"]))


def _looks_like_run(ref: str, runs_dir: str | None) -> bool:
    from hpc_tools.registry import runs_root

    return (runs_root(runs_dir) / ref / "manifest.json").is_file()


def request_body(prompt: str | None, ids: list[int] | None, max_tokens: int, temperature: float = 0.0) -> dict:
    if ids is not None:
        inputs = [{"name": "input_ids", "datatype": "INT64", "shape": [1, len(ids)], "data": list(ids)}]
    else:
        inputs = [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": [prompt]}]
    inputs.append({"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [int(max_tokens)]})
    if temperature:
        inputs.append({"name": "temperature", "datatype": "FP32", "shape": [1, 1], "data": [float(temperature)]})
    return {"inputs": inputs}


def infer(endpoint: Endpoint, body: dict, timeout_s: float = 300.0) -> dict:
    """One request -> ``{"ids": [...], "text": str, "batch_size": n}`` (n: requests decoded together with it); a
    refused or failed request is a UserError (one line)."""
    req = urllib.request.Request(endpoint.url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("error", detail)
        except ValueError:
            pass
        # The model's own exception (its traceback's last "XError: message" line), else the first line.
        raised = re.findall(r"(?:^|\n)\s*\w*(?:Error|Exception): ([^\n]+)", detail)
        detail = (raised[-1] if raised else detail.strip().splitlines()[0] if detail.strip() else str(exc))[:300]
        raise UserError(f"the server at {endpoint.host}:{endpoint.http_port} refused the request: {detail}") from None
    except OSError as exc:
        raise UserError(f"no answer from {endpoint.host}:{endpoint.http_port} ({exc}); is it serving? "
                        "(`python -m hpc_tools status RUN` shows the endpoint)") from None
    outputs = {o["name"]: o for o in answer.get("outputs", [])}
    text = outputs.get("text", {}).get("data") or [""]
    batch = outputs.get("batch_size", {}).get("data") or [None]
    return {"ids": [int(t) for t in outputs["output_ids"]["data"]], "text": text[0], "batch_size": batch[0]}


def infer_many(endpoint: Endpoint, bodies: list[dict], concurrency: int = 8) -> list[dict]:
    """Requests sent ``concurrency`` at a time (the server's dynamic batcher groups them); answers in order."""
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(bodies)))) as pool:
        return list(pool.map(lambda b: infer(endpoint, b), bodies))
