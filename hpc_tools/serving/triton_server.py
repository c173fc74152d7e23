"""The serving job's server: a Hugging Face folder behind Triton Inference Server (PyTriton), model ``generate``.

Runs in the serving environment (environment/install-serve.sh), as a file (``python triton_server.py ...``): it
imports nothing of hpc_tools, only the standard library, PyTriton, torch and transformers, so the serving pins never
meet the training ones.

Model ``generate`` (KServe v2 over HTTP and gRPC, Triton's dynamic batcher in front):

- inputs: ``input_ids`` INT64 [-1] or ``text`` BYTES [1] (one of them), ``max_tokens`` INT32 [1], optional
  ``temperature`` FP32 [1] (0, the default: greedy decoding; above 0: sampling at that temperature);
- outputs: ``output_ids`` INT64 [-1] (the generated ids, up to and including an end-of-sequence id, without the
  prompt), ``text`` BYTES [1] (their decoding; empty without a tokenizer) and ``batch_size`` INT32 [1] (how many
  requests were decoded together with this one).

The requests of one dynamic batch that share prompt length, ``max_tokens`` and temperature are decoded together as one
``model.generate`` batch (no padding, so no position or mask changes); the others one group after another.

When the model answers ``/v2/models/generate/ready``, the endpoint ``{host, http_port, grpc_port, pid, ...}`` is
written atomically to ``--endpoint-file``. Bad start (a port in use, a folder that does not load) writes one line to
``--error-file`` and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

MODEL = "generate"
EXIT_BAD_INPUT = 2


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def fail(args: argparse.Namespace, line: str) -> None:
    print(f"hpc_tools serve: {line}", file=sys.stderr, flush=True)
    if args.error_file:
        _write(Path(args.error_file), line + "\n")
    sys.exit(EXIT_BAD_INPUT)


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no use
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def any_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def load_model(auto_class, folder: str, torch):
    """The model on the GPU in bf16 when torch sees one (the job's --gpus), else on the CPU as the folder stores it
    (an export is fp32)."""
    if torch.cuda.is_available():
        return auto_class.from_pretrained(folder, torch_dtype=torch.bfloat16).to("cuda").eval()
    return auto_class.from_pretrained(folder).eval()


def make_infer(model, tokenizer, torch, np):
    """The inference callable: a list of requests (one dynamic batch) -> one response dict each."""
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (min(eos_ids) if eos_ids else 0)

    def prompt_ids(request) -> list[int]:
        if "input_ids" in request:
            return [int(t) for t in np.asarray(request["input_ids"]).reshape(-1)]
        if "text" not in request:
            raise ValueError("a request needs input_ids or text")
        if tokenizer is None:
            raise ValueError("this model folder has no tokenizer: send input_ids")
        raw = np.asarray(request["text"]).reshape(-1)[0]
        text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def infer(requests):
        parsed = []
        for request in requests:
            ids = prompt_ids(request)
            if not ids:
                raise ValueError("empty prompt")
            max_tokens = int(np.asarray(request["max_tokens"]).reshape(-1)[0])
            temperature = float(np.asarray(request["temperature"]).reshape(-1)[0]) if "temperature" in request \
                else 0.0
            parsed.append((ids, max(max_tokens, 0), temperature))
        out: list = [None] * len(parsed)
        groups: dict = {}
        for i, (ids, n, temp) in enumerate(parsed):
            groups.setdefault((len(ids), n, temp), []).append(i)
        for (length, n, temp), members in groups.items():
            if n == 0:
                generated = [[] for _ in members]
            else:
                batch = torch.tensor([parsed[i][0] for i in members], dtype=torch.long, device=model.device)
                sampling = {"do_sample": True, "temperature": temp} if temp > 0 else {"do_sample": False}
                with torch.no_grad():
                    result = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=n,
                                            pad_token_id=pad, **sampling)
                generated = []
                for row in result[:, length:].tolist():
                    cut = next((k + 1 for k, t in enumerate(row) if t in eos_ids), len(row))
                    generated.append(row[:cut])
            for i, ids in zip(members, generated):
                text = tokenizer.decode(ids) if tokenizer is not None else ""
                out[i] = {"output_ids": np.asarray([ids], dtype=np.int64).reshape(1, -1),
                          "text": np.asarray([[text.encode("utf-8")]], dtype=object),
                          "batch_size": np.asarray([[len(members)]], dtype=np.int32)}
        return out

    return infer


def wait_ready(port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{MODEL}/ready", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face model folder")
    p.add_argument("--http-port", type=int, default=8000, help="0: any free port")
    p.add_argument("--grpc-port", type=int, default=8001, help="0: any free port")
    p.add_argument("--host", default=socket.gethostname(), help="the host name clients reach (written)")
    p.add_argument("--endpoint-file", default=None)
    p.add_argument("--error-file", default=None)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--queue-delay-us", type=int, default=2000, help="dynamic batcher's max queue delay")
    p.add_argument("--ready-timeout-s", type=float, default=300)
    return p.parse_args(argv)


def choose_ports(args: argparse.Namespace) -> tuple[int, int]:
    """(HTTP, gRPC) ports: the ones asked for, refused in one line when in use, or any two free ones for 0."""
    for flag in ("http_port", "grpc_port"):
        port = getattr(args, flag)
        if port and not port_free(port):
            fail(args, f"--{flag.replace('_', '-')}={port} is in use on {args.host} "
                       f"(choose another port, or 0 for any free one)")
    http_port = args.http_port or any_free_port()
    grpc_port = args.grpc_port or any_free_port()
    while grpc_port == http_port:
        grpc_port = any_free_port()
    return http_port, grpc_port


def bind_generate(triton, args: argparse.Namespace, model, tokenizer, torch, np) -> None:
    """The ``generate`` model: token ids or text in, greedy (or sampled) tokens out, dynamically batched."""
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

    triton.bind(
        model_name=MODEL,
        infer_func=make_infer(model, tokenizer, torch, np),
        inputs=[Tensor(name="input_ids", dtype=np.int64, shape=(-1,), optional=True),
                Tensor(name="text", dtype=bytes, shape=(1,), optional=True),
                Tensor(name="max_tokens", dtype=np.int32, shape=(1,)),
                Tensor(name="temperature", dtype=np.float32, shape=(1,), optional=True)],
        outputs=[Tensor(name="output_ids", dtype=np.int64, shape=(-1,)),
                 Tensor(name="text", dtype=bytes, shape=(1,)),
                 Tensor(name="batch_size", dtype=np.int32, shape=(1,))],
        config=ModelConfig(max_batch_size=args.max_batch_size,
                           batcher=DynamicBatcher(max_queue_delay_microseconds=args.queue_delay_us)),
        strict=False,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    http_port, grpc_port = choose_ports(args)

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = load_model(AutoModelForCausalLM, args.model, torch)
    except (OSError, ValueError) as exc:
        fail(args, f"--model {args.model} does not load as a Hugging Face causal LM: {str(exc).splitlines()[0]} "
                   "(give a folder from `hpc_tools export`)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError):
        tokenizer = None

    from pytriton.triton import Triton, TritonConfig

    config = TritonConfig(http_port=http_port, grpc_port=grpc_port, allow_metrics=False, exit_on_error=True)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    started = time.monotonic()
    with Triton(config=config) as triton:
        bind_generate(triton, args, model, tokenizer, torch, np)
        triton.run()
        if not wait_ready(http_port, args.ready_timeout_s):
            fail(args, f"Triton did not report model {MODEL} ready within {args.ready_timeout_s:.0f} s "
                       "(see the job log)")
        endpoint = {"host": args.host, "http_port": http_port, "grpc_port": grpc_port, "model": MODEL,
                    "engine": "triton", "pid": os.getpid(), "ready_s": round(time.monotonic() - started, 2),
                    "model_dir": str(Path(args.model).absolute())}
        print(f"hpc_tools serve: ready {json.dumps(endpoint)}", flush=True)
        if args.endpoint_file:
            _write(Path(args.endpoint_file), json.dumps(endpoint))
        while not stopping and triton.is_alive():
            time.sleep(0.5)
    return 0

if __name__ == "__main__":
    sys.exit(main())
