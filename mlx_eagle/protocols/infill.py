"""llama.cpp's ``POST /infill``, as editors' code-completion plug-ins (llama.vim,
llama.vscode) send it: ``input_prefix`` (and ``prompt``, the text just before the cursor),
``input_suffix`` and ``input_extra`` (other files: ``[{"filename", "text"}]``), answered in
llama.cpp's completion shape (``content``, ``stop``, ``tokens_predicted``, ``stop_type``,
``timings``), streamed as ``data:`` lines whose last has ``"stop": true``. The prompt is the
model's own fill-in-the-middle layout (infill.py); a model without its tokens gets a 400.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator

from ..errors import UserError
from ..infill import check_extra, infill_prompt
from ..options import ReplyOptions
from . import Collected, Protocol, Request, RequestError, flag, number, sse, texts, whole


class Infill(Protocol):
    """llama.cpp's infill endpoint."""

    def parse(self, body: Any, engine, default_max_tokens: int) -> Request:
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        pieces = {}
        for name in ("input_prefix", "prompt", "input_suffix"):
            pieces[name] = body.get(name) if body.get(name) is not None else ""
            if not isinstance(pieces[name], str):
                raise RequestError(400, f"{name} must be a string", name)
        extra = check_extra(body.get("input_extra"))
        try:
            infill = infill_prompt(engine.tokenizer, pieces["input_prefix"] + pieces["prompt"], pieces["input_suffix"],
                                   extra)
        except UserError as error:  # a model without fill-in-the-middle tokens: this API's name for the field
            raise UserError(str(error), "input_suffix") from None
        ids, limit = infill.ids, engine.context_length or 1 << 30
        if len(ids) >= limit:
            raise RequestError(400, f"the prompt is {len(ids)} tokens; the model's context holds {limit}",
                               "input_prefix", "context_length_exceeded")
        name = "n_predict" if "n_predict" in body else "max_tokens"
        max_tokens = default_max_tokens if body.get(name) in (None, -1) else whole(body, name, 1, limit)
        options = ReplyOptions(max_tokens=max_tokens, temp=number(body, "temperature", 0.0, 0.0, 2.0),
                               top_p=number(body, "top_p", 1.0, 0.0, 1.0),
                               top_k=whole(body, "top_k", 0, 1 << 30, default=0), stop=texts(body, "stop", 16),
                               seed=body.get("seed"), stop_tokens=infill.stop_tokens)
        return Request(ids=ids, chat=False, stream=flag(body, "stream"), options=options, model=engine.name,
                       protocol=self)

    def error(self, error: RequestError) -> Dict[str, Any]:
        kind = "server_error" if error.status >= 500 else "invalid_request_error"
        return {"error": {"code": error.status, "message": error.message, "type": kind}}

    def stream_error(self, error: RequestError) -> bytes:
        return sse(None, self.error(error))

    @staticmethod
    def _final(request: Request, last, usage: Dict[str, Any]) -> Dict[str, Any]:
        stop_type = {"length": "limit"}.get(last.finish_reason, "word" if last.stop_sequence else "eos")
        return {"stop": True, "model": request.model, "tokens_predicted": usage["completion_tokens"],
                "tokens_evaluated": usage["prompt_tokens"], "tokens_cached": usage["prompt_tokens_details"]
                ["cached_tokens"], "stop_type": stop_type, "stopping_word": last.stop_sequence or "",
                "timings": {"prompt_n": usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"],
                            "predicted_n": usage["completion_tokens"],
                            "predicted_per_second": usage["speculation"]["tokens_per_second"]},
                "usage": usage}

    def reply(self, request: Request, collected: Collected, usage: Dict[str, Any]) -> Dict[str, Any]:
        return {"content": collected.text, **self._final(request, collected.last, usage)}

    def events(self, request: Request, responses: Iterator[Any],
               usage: Callable[[Any], Dict[str, Any]]) -> Iterator[bytes]:
        last = None
        for last in responses:
            if last.finish_reason is None:
                yield sse(None, {"content": last.text, "stop": False})
        if last is None or last.finish_reason is None:
            return  # cut off: the server says so in its own error event
        yield sse(None, {"content": last.text, **self._final(request, last, usage(last))})
