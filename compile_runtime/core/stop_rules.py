"""When a request stops, what it keeps of a step's tokens, and how many drafts it may get.

Once a request has ``min_tokens`` outputs, an EOS id (unless ``ignore_eos``) or a
stop token id stops it; ``max_tokens`` outputs end it. A step that verified drafts
can give a request several tokens: the ones after a token that stops it are
dropped. Drafts never reach past ``max_tokens``: the step verifying them emits at
least one token more.
"""

from __future__ import annotations

from compile_runtime.core.request import Request, RequestStatus


def stop_status(req: Request, token: int) -> RequestStatus | None:
    """How ``token``, just appended to ``req``'s outputs, ends the request (None: it goes on)."""
    params = req.sampling_params
    num_out = len(req.output_token_ids)
    if num_out >= params.min_tokens:
        if token in req.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if num_out >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None


def append_until_stop(
    req: Request, tokens: list[int], logprobs: list | None
) -> RequestStatus | None:
    """Append ``tokens`` to ``req``'s outputs up to the first that stops it; the ones after it
    are deleted from ``tokens`` and ``logprobs`` too (the caller's lists, in place)."""
    for kept, token in enumerate(tokens, 1):
        req.output_token_ids.append(token)
        status = stop_status(req, token)
        if status is not None:
            del tokens[kept:]
            if logprobs is not None:
                del logprobs[kept:]
            return status
    return None


def ended_by_stop_token(req: Request) -> bool:
    """Whether ``req`` ended at a stop token (an EOS id or one of ``stop_token_ids``): its
    last output. Its text is left out of the output text (kept with
    ``include_stop_str_in_output``), as vLLM does; the id stays in the token ids."""
    if req.status is not RequestStatus.FINISHED_STOPPED or not req.output_token_ids:
        return False
    last, params = req.output_token_ids[-1], req.sampling_params
    return last in params.stop_token_ids or (last in req.eos_token_ids and not params.ignore_eos)


def capped_drafts(req: Request, proposed: list[int]) -> list[int]:
    """The drafts ``req`` may verify next step: never past max_tokens."""
    room = req.sampling_params.max_tokens - len(req.output_token_ids) - 1
    return proposed[: max(room, 0)]
