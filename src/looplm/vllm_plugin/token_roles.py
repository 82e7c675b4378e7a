"""Which of a vLLM step's tokens are prompt tokens: a small hook on vLLM's V1 model runner.

looplm runs prompt tokens at `prefill_steps` recurrences and decoded tokens at `num_steps` (with
adaptive exit, `exit_tau`, for decoded tokens only), so the model must know, per token of vLLM's flat
batch, whether it is its request's prompt. vLLM 0.32 does not pass that to a model: the forward gets
token ids and positions, and the attention metadata has query and sequence lengths but no prompt
length (a query length of 1 does not mark a decoded token: a one-token prompt has one too). The model
runner has it: `input_batch.num_prompt_tokens[i]` and `input_batch.num_computed_tokens_cpu[i]` of
each request i, and the step's `num_scheduled_tokens`, in the batch's token order (request by
request, each request's scheduled tokens in position order). A token is a prompt token iff its
position < its request's prompt length.

What is hooked: `vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs(scheduler_output,
num_scheduled_tokens)` (the CPU runner, `CPUModelRunner`, inherits it). The wrapper calls vLLM's
method unchanged, then, when the runner's model is a looplm model that asked for token roles
(`ROLES_ATTRIBUTE`), writes the roles of the step's tokens into that model's persistent device
buffer (1 = prompt token, 0 = decoded token), through a pinned host buffer and a non-blocking copy,
on the runner's stream, inside the runner's own input preparation (so the copy is ordered like
vLLM's own input copies: the forward's compiled graph or CUDA graph reads a buffer at a fixed
address, and the forward itself makes no host-to-device copy). Every other model is untouched.
`install()` runs when a looplm model that needs the roles is built (inside the runner's
`load_model`, before any step); it raises `Refused` if this vLLM lacks the hooked method or the
input-batch fields, or runs its V2 model runner (which does not call `_prepare_inputs`), so such a
version fails at load, never silently.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

ROLES_ATTRIBUTE = "looplm_token_roles"
"""The model attribute the hook fills: a device tensor [max tokens] (int8), 1 = prompt token."""

KINDS_ATTRIBUTE = "looplm_step_kinds"
"""The model attribute the hook also sets, on the host: (the step has prompt tokens, it has decoded tokens).
An eager forward reads it to run no more recurrences than the step's tokens need (no host sync); a
compiled one does not read it."""

_HOOK_MARK = "_looplm_token_roles_hook"


class _Staging:
    """The host side of one model's roles buffer: the buffer itself on a CPU, else a pinned copy."""

    def __init__(self, device_buffer: torch.Tensor):
        cpu = device_buffer.device.type == "cpu"
        self.host = (
            device_buffer
            if cpu
            else torch.zeros(
                device_buffer.shape, dtype=device_buffer.dtype, pin_memory=device_buffer.device.type == "cuda"
            )
        )
        self.filled = 0  # tokens written by the last step (later entries are already 0)


def token_roles(num_scheduled: np.ndarray, num_computed: np.ndarray, num_prompt: np.ndarray) -> np.ndarray:
    """1 for each scheduled token whose position is below its request's prompt length, else 0, in vLLM's
    token order. Arrays per request (the step's requests, in input-batch order): the tokens scheduled,
    the tokens already computed (so the request's first scheduled token sits at that position), the
    prompt's length."""
    n = np.asarray(num_scheduled, dtype=np.int64)
    prompt_left = np.asarray(num_prompt, dtype=np.int64) - np.asarray(num_computed, dtype=np.int64)
    offset = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # each token's index within its request
    return (offset < np.repeat(prompt_left, n)).astype(np.int8)


def _fill(runner, num_scheduled_tokens: np.ndarray) -> None:
    model = runner.get_model()
    buffer = getattr(model, ROLES_ATTRIBUTE, None)
    if buffer is None:
        return
    staging = getattr(model, "_looplm_roles_staging", None)
    if staging is None:
        staging = _Staging(buffer)
        model._looplm_roles_staging = staging
    batch = runner.input_batch
    k = batch.num_reqs
    roles = token_roles(num_scheduled_tokens[:k], batch.num_computed_tokens_cpu[:k], batch.num_prompt_tokens[:k])
    T = roles.shape[0]
    if T > buffer.shape[0]:
        raise RuntimeError(f"looplm: a step of {T} tokens exceeds the roles buffer ({buffer.shape[0]} tokens)")
    end = max(T, staging.filled)  # clear what the last, longer step left (padding tokens read 0)
    host = staging.host.numpy()
    host[:T] = roles
    host[T:end] = 0
    if staging.host is not buffer:
        buffer[:end].copy_(staging.host[:end], non_blocking=True)
    staging.filled = T
    setattr(model, KINDS_ATTRIBUTE, (bool(roles.any()), not bool(roles.all())))


def install(vllm_config) -> None:
    """Wrap the V1 model runner's `_prepare_inputs` once per process (idempotent); `Refused` naming what
    is missing when this vLLM cannot be hooked."""
    from looplm.vllm_plugin.model import Refused

    reason = (
        "the looplm vLLM plugin serves prefill_steps != num_steps and exit_tau through a hook on vLLM's "
        "V1 model runner (vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs and its "
        "input_batch.num_prompt_tokens / num_computed_tokens_cpu, vLLM 0.32)"
    )
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise Refused(
            f"{reason}; this engine runs vLLM's V2 model runner: set VLLM_USE_V2_MODEL_RUNNER=0, or "
            "serve with prefill_steps equal to num_steps and no exit_tau"
        )
    try:
        from vllm.v1.worker import gpu_input_batch, gpu_model_runner
    except ImportError as err:
        raise Refused(f"{reason}; this vLLM has no such module ({err})") from err
    runner_cls = getattr(gpu_model_runner, "GPUModelRunner", None)
    original = getattr(runner_cls, "_prepare_inputs", None)
    if original is None:
        raise Refused(f"{reason}; this vLLM's GPUModelRunner has no _prepare_inputs")
    batch_init = getattr(getattr(gpu_input_batch, "InputBatch", None), "__init__", None)
    names = getattr(getattr(batch_init, "__code__", None), "co_names", ())
    missing = [f for f in ("num_prompt_tokens", "num_computed_tokens_cpu") if f not in names]
    if missing:
        raise Refused(f"{reason}; this vLLM's InputBatch has no {', '.join(missing)}")
    if getattr(original, _HOOK_MARK, False):
        return

    @functools.wraps(original)
    def prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        out = original(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        _fill(self, num_scheduled_tokens)
        return out

    setattr(prepare_inputs, _HOOK_MARK, True)
    runner_cls._prepare_inputs = prepare_inputs
