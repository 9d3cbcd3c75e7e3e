"""A teacher served by API for `swift rlhf --teacher_model_server URL` on CPU, without vLLM.

ms-swift's trainers talk to `swift rollout` (vLLM) through VLLMInferClient: GET /health, then POST /infer/ with
{"infer_requests": [...], "request_config": {"prompt_logprobs": k, ...}} per batch, and read each response's
`prompt_logprobs` (vLLM's layout: entry i maps token ids to {"logprob", "rank"} for predicting prompt token i, entry
0 is null). This server answers the same two routes from a local model: each request is encoded with the model's
ms-swift template (as the rollout server's engine encodes it), one forward in fp32 gives every position's
log-softmax, and each position lists its k largest log-probs (k = 0: the actual next token's only, as vLLM does).

    python teacher_server.py MODEL_DIR MODEL_TYPE TEMPLATE PORT_FILE

binds 127.0.0.1 on a free port and writes it to PORT_FILE once the model has loaded; it counts the requests it
scored in PORT_FILE + ".count" (one line per POST: how many requests it held).
"""
from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


def prompt_logprobs(logits, input_ids, k: int) -> list:
    """vLLM's prompt_logprobs from one sequence's [L, V] logits: [None, {id: {"logprob", "rank"}}, ...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)   # row t predicts token t + 1
    out = [None]
    for t in range(1, len(input_ids)):
        row = logp[t - 1]
        if k == 0:
            tid = int(input_ids[t])
            rank = int((row > row[tid]).sum()) + 1
            out.append({str(tid): {"logprob": float(row[tid]), "rank": rank}})
        else:
            vals, ids = row.topk(k)
            out.append({str(int(i)): {"logprob": float(v), "rank": r + 1} for r, (v, i) in enumerate(zip(vals, ids))})
    return out


def main(model_dir: str, model_type: str, template_type: str, port_file: str) -> None:
    from swift.infer_engine import InferRequest, TransformersEngine

    engine = TransformersEngine(model_dir, torch_dtype=torch.float32, model_type=model_type,
                                template_type=template_type, device_map="cpu")
    model, template = engine.model, engine.template
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):   # quiet: the trainer's log is the one read
            pass

        def _send(self, code: int, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200 if self.path.rstrip("/") == "/health" else 404, {})

        def do_POST(self):
            if self.path.rstrip("/") != "/infer":
                return self._send(404, {"detail": f"no route {self.path}"})
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            k = int((body.get("request_config") or {}).get("prompt_logprobs") or 0)
            results = []
            with lock, torch.no_grad():
                for req in body["infer_requests"]:
                    fields = {f: req[f] for f in ("messages", "images", "tools", "chat_template_kwargs")
                              if req.get(f) is not None}
                    ids = template.encode(InferRequest(**fields))["input_ids"]
                    logits = model(input_ids=torch.tensor([ids])).logits[0]
                    results.append({
                        "model": model_type, "prompt_token_ids": ids,
                        "prompt_logprobs": prompt_logprobs(logits, ids, k),
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                                     "finish_reason": "length"}],
                        "usage": {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}})
                with open(port_file + ".count", "a") as f:
                    f.write(f"{len(results)}\n")
            self._send(200, results)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(port_file + ".tmp", port_file)
    server.serve_forever()


if __name__ == "__main__":
    main(*sys.argv[1:5])
