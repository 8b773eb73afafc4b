"""The timings of one generation, as every mode reports them (llama-decode --json, a batch result
line, a chat turn): one dict built in one place. Pure Python, imported by synapse_nb.engine and
synapse_nb.chat (which the tokenizer imports, so it cannot import the engine).
"""

from __future__ import annotations


def timings(n_prompt: int, prompt_s: float, n_evals: int, eval_s: float, n_threads: int) -> dict:
    """The per-generation timings of llama-decode --json and of a batch result line: prompt_ms,
    prompt_tokens_per_s, eval_ms, eval_tokens_per_s (None when not measurable), n_threads."""
    prompt_ms, eval_ms = 1e3 * prompt_s, 1e3 * eval_s
    return {
        "prompt_ms": round(prompt_ms, 2),
        "prompt_tokens_per_s": round(n_prompt / (prompt_ms / 1e3), 2) if prompt_ms > 0 else None,
        "eval_ms": round(eval_ms, 2),
        "eval_tokens_per_s": round(n_evals / (eval_ms / 1e3), 2) if n_evals and eval_ms > 0 else None,
        "n_threads": n_threads,
    }
