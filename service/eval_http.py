"""`dsv4 eval --url`: the eval's model as a running service, through its OpenAI /v1/completions route.

`HttpModel.generate(prompts, params)` stands in for `LLM.generate` in service.eval_perplexity / eval_tasks: each
prompt goes as token ids (so BOS and the windows are exactly the engine path's), greedy, with `echo` + `logprobs`
when prompt logprobs are wanted (the echoed prompt's `token_logprobs`, None first) and `return_token_ids` for the
continuation. Requests run a few at a time from threads, on the standard library's http client alone.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass(frozen=True)
class HttpOutput:
    token_ids: list
    prompt_logprobs: list | None


class HttpModel:
    def __init__(
        self, url: str, model: str = "dsv4", api_key: str | None = None, concurrency: int = 4, timeout_s: float = 600.0
    ):
        self.endpoint = url.rstrip("/") + ("" if url.rstrip("/").endswith("/v1") else "/v1") + "/completions"
        self.model, self.api_key, self.concurrency, self.timeout_s = model, api_key, concurrency, timeout_s

    def _post(self, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.endpoint, json.dumps(body).encode(), headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return json.loads(resp.read())

    def _one(self, prompt: list[int], params) -> HttpOutput:
        body = {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": params.max_new_tokens,
            "temperature": 0,
            "ignore_eos": params.ignore_eos,
            "return_token_ids": True,
        }
        if params.prompt_logprobs:
            body.update(echo=True, logprobs=0)
        choice = self._post(body)["choices"][0]
        lps = choice["logprobs"]["token_logprobs"][: len(prompt)] if params.prompt_logprobs else None
        return HttpOutput(list(choice.get("token_ids") or []), lps)

    def generate(self, prompts, params) -> list[HttpOutput]:
        if params.temperature != 0.0:
            raise ValueError("the eval over HTTP is greedy only")
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(lambda p: self._one(p, params), prompts))
