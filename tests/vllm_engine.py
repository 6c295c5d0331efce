"""Runs a real vLLM engine on CPU in its own process, for tests/test_adapter_vllm.py and
benchmarks/bench_vllm.py: `python tests/vllm_engine.py JOB.json OUT.json`.

JOB: {"model": dir, "connector": extra config dict or null, "chunked_prefill": bool,
      "rounds": [[{"tokens": [...], "max_tokens": n, "params": kv_transfer_params or null,
                   "salt": cache_salt or null}, ...], ...], "reset_between_rounds": true,
      "connector_class": optional (e.g. "ExampleConnector"), "kv_load_failure_policy": optional,
      "probe": optional path of a safetensors file {"kv": canonical [layers, 2, n, heads, dim]},
      "num_blocks": optional KV pool size in blocks, "tp": optional tensor parallel size, "batched": every round in one generate call,
      "sleep": optional seconds to wait before each round (a tool pause: the store's writes land),
      "round_metrics": true to read the metrics after every round,
      "hold": optional {"ready": path, "release": path}: after the rounds, write OUT's rounds to
              `ready` and keep the engine (and its data directory) alive until `release` exists}
OUT:  {"rounds": [[{"tokens": [...], "cached": num_cached_tokens, "ttft": s, "e2e": s}]],
       "metrics": {name: value}, "round_metrics": [{name: value} after each round] when asked,
       "probe": BlockProbe.probe_blocks's answer when asked}
Metrics are summed by name; one with a `tier` label is keyed `name{tier}` (vllm:agentstate_bytes_read{lmdb}).

One request per `generate` call and float32, so outputs are deterministic (shared/notes/vllm-cpu.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time


def make_model(path: str, *, layers: int = 2, hidden: int = 128, heads: int = 2, kv_heads: int = 2,
               vocab: int = 512, seed: int = 0, head_dim: int | None = None, chat: bool = False) -> str:
    """A tiny random-weight Llama in float32 (safetensors) and a WordLevel tokenizer, in `path`
    (`head_dim`: other than hidden / heads, for more KV per token at little more compute).

    `chat`: text round-trips through the tokenizer (what a chat template needs): the special tokens
    get names of their own (`<unk>`, `</s>`, `<s>`), since transformers matches added tokens
    anywhere in a text and would cut `t158` into `t1` + `58`; and a chat template whose generation
    prompt opens the assistant's turn as the template renders a past one, so a turn's prompt
    extends the previous turn's tokens exactly."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=16384,
                         torch_dtype="float32", tie_word_embeddings=False,
                         **({"head_dim": head_dim} if head_dim else {}))
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # sharper logits: greedy tokens depend on the context, not on noise
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(path, vocab, chat)
    return path


def _tokenizer(path: str, vocab: int, chat: bool) -> None:
    """A WordLevel tokenizer of words t<id> (see make_model's `chat`)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "</s>", "<s>"] if chat else ["t0", "t1", "t2"]
    vocab_map = {**{name: i for i, name in enumerate(specials)}, **{f"t{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(WordLevel(vocab_map, unk_token=specials[0]))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=specials[0], eos_token=specials[1],
                                   bos_token=specials[2])  # fmt: skip
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def make_hybrid_model(path: str, *, layers: int = 4, vocab: int = 512, seed: int = 0) -> str:
    """A tiny random-weight Qwen3-Next (GatedDeltaNet layers between full-attention ones, every other
    layer) in bfloat16, with the tokenizer of `make_model`: a hybrid model vLLM's CPU backend runs
    (its GDN kernel wants bf16 and 128-wide linear-attention heads; vLLM widens the attention blocks
    to hold a GDN state's bytes: 288 tokens here)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=128,
        linear_value_head_dim=128, moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, full_attention_interval=2, max_position_embeddings=16384, torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(path, vocab, chat=False)
    return path


def make_sliding_model(path: str, *, vocab: int = 512, seed: int = 0) -> str:
    """A tiny random-weight Gemma 3 in float32: sliding-window layers (a 64-token window) between
    full-attention ones, which vLLM keeps in KV cache groups of their own (sliding blocks leave a
    running request once behind its window)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, sliding_window=64, max_position_embeddings=16384, torch_dtype="float32",
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    )  # fmt: skip
    Gemma3ForCausalLM(config).to(torch.float32).save_pretrained(path, safe_serialization=True)
    _tokenizer(path, vocab, chat=False)
    return path


CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}t5 {{ m['content'] or '' }} t4 "
    "{% elif m['role'] == 'tool' %}t6 {{ m['content'] }} t4 {% else %}t3 {{ m['content'] }} t4 {% endif %}"
    "{% endfor %}{% if add_generation_prompt %}t5 {% endif %}"
)
"""Roles as tokens (t3 user/system, t5 assistant, t6 tool, t4 end of a message); text is words t<id>."""


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a server started in its own process group: SIGTERM (the connector closes its store),
    SIGKILL after 90 s, then whatever of the group is left (vLLM's engine core and worker leave it last)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    time.sleep(1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


class BlockProbe:
    """Worker extension (tests only; `worker_extension_cls`): finds, in the engine's own KV caches,
    the blocks that hold given canonical KV, so a test can compare blocks the connector loaded with
    blocks vLLM computed itself. Reads the caches through the adapter's CPU layout to find them, then
    compares the blocks' raw memory, which needs no layout at all."""

    def probe_blocks(self, path: str, block_size: int, tol: float) -> list[dict]:
        from safetensors.torch import load_file

        from agentstate.adapters.vllm.blocks import layout_for

        expected = load_file(path)["kv"]  # [layers, 2, n, heads, dim]
        layers, _, n, heads, dim = expected.shape
        caches = list(self.model_runner.kv_caches)  # type: ignore[attr-defined]
        lay = layout_for("CPU_ATTN", "vec", block_size=block_size, heads=heads, dim=dim)
        planes = [lay.planes(c) for c in caches]
        out = []
        for w in range(n // block_size):
            want = expected[:, :, w * block_size : (w + 1) * block_size]
            near = (planes[0][0][:, 0, 0] - want[0, 0, 0, 0]).abs().amax(dim=1) < tol  # K of token 0, head 0
            found = []
            for b in near.nonzero().flatten().tolist():
                diff = max(float((planes[i][p][b] - want[i, p]).abs().max()) for i in range(layers) for p in (0, 1))
                if diff < tol:
                    found.append([b, diff])
            exact = [b for b, diff in found if diff == 0.0]
            raw = {  # raw memory of each other block holding these tokens against the first exact one
                str(b): max(float((c[b] - c[exact[0]]).abs().max()) for c in caches)
                for b, _ in found if exact and b != exact[0]
            }  # fmt: skip
            out.append({"blocks": found, "exact": exact, "raw_vs_exact": raw})
        return out


def read_metrics(llm: object) -> dict:
    """The engine's prefix-cache, preemption and agentstate metrics, summed by name (and tier)."""
    metrics: dict = {}
    try:
        for metric in llm.get_metrics():  # type: ignore[attr-defined]
            if any(k in metric.name for k in ("agentstate", "external_prefix_cache", "prefix_cache", "preemptions")):
                value = getattr(metric, "value", None)
                if value is not None:
                    tier = (getattr(metric, "labels", None) or {}).get("tier")
                    name = f"{metric.name}{{{tier}}}" if tier else metric.name
                    metrics[name] = metrics.get(name, 0) + value
    except Exception as exc:  # noqa: BLE001
        metrics["error"] = repr(exc)
    return metrics


def wait_for_hints(llm: object, count: int, limit_s: float = 120) -> None:
    """Step the engine with one-token requests (shorter than a chunk: nothing stored, nothing
    loaded) until the connector's hint counter reaches `count`: its stats reach the metrics only
    with an engine step, and a hint lands on the store's loop after the request's saves."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    deadline = time.monotonic() + limit_s
    n = 0
    while read_metrics(llm).get("vllm:agentstate_hints", 0) < count:
        assert time.monotonic() < deadline, f"fewer than {count} hints applied in {limit_s} s"
        n += 1
        llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7 + n % 400])],  # type: ignore[attr-defined]
                     SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        time.sleep(0.05)


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict = {"model": job["model"], "dtype": job.get("dtype", "float32"), "enforce_eager": True,
                    "enable_prefix_caching": True,
                    "max_model_len": job.get("max_model_len", 8192), "seed": 0, "disable_log_stats": False,
                    "enable_chunked_prefill": bool(job.get("chunked_prefill", False))}
    if job.get("chunked_prefill"):
        kwargs["max_num_batched_tokens"] = job.get("max_num_batched_tokens", 256)
    else:
        kwargs["max_num_batched_tokens"] = job.get("max_model_len", 8192)
    if job.get("connector") is not None:
        cls = job.get("connector_class", "AgentStateConnector")
        cfg = {"kv_connector": cls, "kv_role": "kv_both", "kv_connector_extra_config": job["connector"]}
        if cls == "AgentStateConnector":
            cfg["kv_connector_module_path"] = "agentstate.adapters.vllm"
        kwargs["kv_transfer_config"] = cfg
    if job.get("kv_events"):  # the engine's own KV events (its GPU blocks), beside the connector's
        kwargs["kv_events_config"] = job["kv_events"]
    if job.get("tp"):  # tensor parallel ranks: one worker process each (gloo and shared memory on CPU)
        kwargs["tensor_parallel_size"] = job["tp"]
        kwargs["distributed_executor_backend"] = "mp"
        # vLLM binds each rank's OpenMP threads to a NUMA node of its own by default: one node here
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if job.get("block_size"):
        kwargs["block_size"] = job["block_size"]
    if job.get("num_blocks"):  # a small KV pool: requests get preempted
        kwargs["num_gpu_blocks_override"] = job["num_blocks"]
    if job.get("probe"):
        kwargs["worker_extension_cls"] = "vllm_engine.BlockProbe"
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    out = {"startup_s": time.perf_counter() - t0, "rounds": [], "round_metrics": []}
    for i, requests in enumerate(job["rounds"]):
        sleeps = job.get("sleep", [])
        if i < len(sleeps) and sleeps[i]:
            time.sleep(sleeps[i])
        wait_hints = job.get("wait_hints", {}).get(str(i))
        if wait_hints:  # until the worker applied that many hints (a loaded machine: a sleep is not enough)
            wait_for_hints(llm, wait_hints)
        resets = job.get("reset", [])
        if i and (resets[i] if i < len(resets) else job.get("reset_between_rounds", True)):
            # blocks of a finished session request stay held until its snapshot is written: retry
            deadline = time.monotonic() + 60
            while not llm.reset_prefix_cache() and time.monotonic() < deadline:
                time.sleep(0.05)
        results = []
        if job.get("batched"):  # every request of the round in one generate call (they run together)
            prompts = [TokensPrompt(prompt_token_ids=r["tokens"]) for r in requests]
            sps = [SamplingParams(temperature=0.0, max_tokens=r.get("max_tokens", 8), ignore_eos=True) for r in requests]
            t = time.perf_counter()
            outs = llm.generate(prompts, sps, use_tqdm=False)
            e2e = time.perf_counter() - t
            results = [{"prompt": r["tokens"], "tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
                        "ttft": None, "e2e": e2e} for r, o in zip(requests, outs)]  # fmt: skip
            requests = []
        for req in requests:
            if req.get("continue"):  # the prompt and output of an earlier request, then `extra` tokens
                r, k = req["continue"]
                prev = out["rounds"][r][k]
                req = {**req, "tokens": prev["prompt"] + prev["tokens"] + req.get("extra", [])}
            extra = {"kv_transfer_params": req["params"]} if req.get("params") else None
            sp = SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 8), ignore_eos=True,
                                extra_args=extra)
            prompt = TokensPrompt(prompt_token_ids=req["tokens"])
            if req.get("salt"):
                prompt["cache_salt"] = req["salt"]
            t = time.perf_counter()
            (res,) = llm.generate([prompt], sp, use_tqdm=False)
            e2e = time.perf_counter() - t
            m = res.metrics
            ttft = getattr(m, "first_token_latency", None) if m is not None else None
            results.append({"prompt": req["tokens"], "tokens": list(res.outputs[0].token_ids),
                            "cached": res.num_cached_tokens,
                            "ttft": ttft, "e2e": e2e})
        out["rounds"].append(results)
        if job.get("round_metrics"):
            out["round_metrics"].append(read_metrics(llm))
    out["metrics"] = read_metrics(llm)
    hold = job.get("hold")
    if hold:  # an engine left running: another one is started on the same directory meanwhile
        tmp = hold["ready"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, hold["ready"])
        deadline = time.monotonic() + hold.get("max_s", 900)
        while not os.path.exists(hold["release"]) and time.monotonic() < deadline:
            time.sleep(0.2)
    if job.get("probe"):
        bs = llm.llm_engine.vllm_config.cache_config.block_size
        out["probe"] = llm.collective_rpc("probe_blocks", args=(job["probe"], bs, 1e-3))[0]
    llm.llm_engine.engine_core.shutdown()
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        job = json.load(f)
    if job.get("make_model"):
        make_model(job["model"])
    result = run(job)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
