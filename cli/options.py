"""llama-decode's options in groups (click decorators composed per group), and the one table of
what a mode does with a flag it does not use.

The integer and sampling options are generated from synapse_nb.options, the one parameter table
(names, types, ranges, defaults). The server's group is cli/server.py's.
"""

from __future__ import annotations

import click

from synapse_nb.options import RUN, SAMPLING, REFUSED as REFUSED_SAMPLERS

from .common import COUNT, AtLeast, log

MODES = ("complete", "chat", "batch", "perplexity", "server")

# What a mode does with a flag it does not use: by default it accepts it and ignores it (as
# llama.cpp's tools take their common flags whatever they read); the flags below are refused by
# the modes named, each with the mode's message (or the row's own). Checked in this order (the
# first refused flag given is named): (option name, as named in messages, {mode: message or None}).
_CHAT_ONLY = "-sys/--system-prompt and --chat-template-file apply to -cnv/--conversation or -st/--single-turn"
_NO_GRAMMAR = "a grammar or JSON schema does not apply to --perplexity / --kl-divergence"
_RAY_ONLY = "--replicas goes with --server --ray"
MESSAGES = {
    "chat": "{flag} does not apply to -cnv/--conversation or -st/--single-turn",
    "batch": "{flag} does not go with --batch (the prompts are the lines of IN)",
    "perplexity": "--perplexity / --kl-divergence do not combine with --logits-out, --prefill-check or --tokenize",
    "server": "--server takes no prompt and does not combine with --batch, --perplexity, -cnv or -st (requests bring "
              "the prompts)",
}
REFUSED = (
    ("replicas", "--replicas", dict.fromkeys(("complete", "chat", "batch", "perplexity"), _RAY_ONLY)),
    ("prompt", "PROMPT", {"batch": None, "server": None}),
    ("file", "-f/--file", {"batch": None, "server": None}),
    ("tokens", "--tokens", {"chat": None, "batch": None}),
    ("tokenize_only", "--tokenize", {"chat": None, "batch": None, "perplexity": None}),
    ("as_json", "--json", {"batch": None}),
    ("logits_out", "--logits-out", {"chat": None, "batch": None, "perplexity": None}),
    ("prefill_check", "--prefill-check", {"chat": None, "batch": None, "perplexity": None}),
    ("no_parse_special", "--no-parse-special", {"chat": None}),
    ("no_add_special", "--no-add-special", {"chat": None}),
    ("conversation", "-cnv/--conversation", {"batch": None, "server": None}),
    ("single_turn", "-st/--single-turn", {"batch": None, "server": None}),
    ("system_prompt", "-sys/--system-prompt", {"batch": None, "complete": _CHAT_ONLY}),
    ("chat_template_file", "--chat-template-file", {"batch": None, "complete": _CHAT_ONLY}),
    ("batch_in", "--batch", {"server": None}),
    ("ppl", "--perplexity", {"server": None}),
    ("grammar", "--grammar", {"perplexity": _NO_GRAMMAR}),
    ("grammar_file", "--grammar-file", {"perplexity": _NO_GRAMMAR}),
    ("json_schema", "-j/--json-schema", {"perplexity": _NO_GRAMMAR}),
    ("json_schema_file", "-jf/--json-schema-file", {"perplexity": _NO_GRAMMAR}),
)


def refuse_unused(mode: str, o) -> None:
    """click.UsageError for the first flag of REFUSED that o (the command's options) gives and mode refuses."""
    for name, flag, modes in REFUSED:
        if mode in modes and getattr(o, name) not in (None, False):
            raise click.UsageError((modes[mode] or MESSAGES[mode]).format(flag=flag))


def mode_of(o) -> str:
    """The mode the options ask for: --server, then the perplexity tool, batch mode, a chat, else completion."""
    if o.server:
        return "server"
    if o.ppl or o.kl_div or o.kld_base is not None:
        return "perplexity"
    if o.batch_in is not None or o.batch_out is not None or o.workers is not None or o.ray_address is not None:
        return "batch"
    if o.conversation or o.single_turn:
        return "chat"
    return "complete"


def _compose(opts):
    def apply(f):
        for o in reversed(opts):
            f = o(f)
        return f

    return apply


def _int_option(p, **kw):
    """An integer option of the table: click's dest is the parameter's key, its range and default the
    table's."""
    return click.option(*p.flags, p.key, type=AtLeast(p.lo, p.note, p.hi), metavar=p.metavar, help=p.help,
                        default=p.default, **kw)


_R = {p.key: p for p in RUN}

prompt_options = _compose([
    click.argument("model", required=False),
    click.argument("prompt", required=False),
    click.option("-m", "--model", "model_opt", type=str, default=None, metavar="FNAME",
                 help="The model (llama.cpp's -m), instead of MODEL: then the first argument is PROMPT."),
    click.option("-f", "--file", type=str, default=None, metavar="FILE", help="Read the prompt from this file."),
    click.option("-p", "--prompt", "prompt_opt", type=str, default=None, metavar="TEXT",
                 help="The prompt (llama.cpp's -p), instead of PROMPT; the first user turn with -cnv/-st."),
])

run_options = _compose([
    _int_option(_R["n_predict"], show_default=True),
    _int_option(_R["n_ctx"]),
    _int_option(_R["n_batch"], show_default=True),
    _int_option(_R["n_threads"]),
    click.option("-ngl", "--gpu-layers", "--n-gpu-layers", "gpu_layers", type=str, default=None, metavar="N",
                 help="Accepted for llama.cpp's scripts and ignored: no GPU offload (a CPU decoder)."),
    click.option("--ignore-eos", is_flag=True, help="Do not stop at end-of-generation tokens."),
    click.option("--swa-full", is_flag=True,
                 help="Sliding-window layers keep every position (llama.cpp's --swa-full; the same results, more "
                      "memory); by default they hold their window and a batch."),
    click.option("-v", "--verbose", is_flag=True, help="More logs on stderr; tracebacks on errors."),
])

completion_options = _compose([
    click.option("--no-parse-special", is_flag=True, help="Treat special-token text in the prompt as plain text."),
    click.option("--no-add-special", is_flag=True, help="Do not add BOS/EOS to the prompt."),
    click.option("--tokens", type=str, default=None, metavar="ID,ID,...",
                 help="Prompt as token ids, used exactly as given (no BOS added)."),
    click.option("--tokenize", "tokenize_only", is_flag=True, help="Print the prompt's token ids as JSON and exit."),
    click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text."),
    click.option("--logits-out", type=str, default=None, metavar="PATH.npy",
                 help="Save float32 logits [n_prompt + n_generated - 1, n_vocab] (never overwrites)."),
    click.option("--prefill-check", is_flag=True,
                 help="Check that batched prefill equals token-by-token decoding bit for bit; exit 1 if not."),
])

chat_options = _compose([
    click.option("-cnv", "--conversation", is_flag=True,
                 help="Chat: one user turn per line of stdin ('> ' on a terminal), replies streamed; /exit or EOF "
                      "ends."),
    click.option("-st", "--single-turn", is_flag=True,
                 help="Chat for one turn: PROMPT/-p/-f (else one stdin line) as the user message, then exit."),
    click.option("-sys", "--system-prompt", type=str, default=None, metavar="TEXT",
                 help="System message at the start of the chat (-cnv/-st)."),
    click.option("--chat-template-file", type=str, default=None, metavar="FILE",
                 help="Jinja chat template to use instead of the model's tokenizer.chat_template."),
    click.option("--jinja/--no-jinja", default=True, show_default=True,
                 help="Run the chat template (--jinja), or use the built-in ChatML format (--no-jinja)."),
])

batch_options = _compose([
    click.option("--batch", "batch_in", type=str, default=None, metavar="IN.jsonl",
                 help='Batch mode: one input per line, {"id": ..., "prompt": "..."} or {"id": ..., "tokens": [...]}.'),
    click.option("--output", "batch_out", type=str, default=None, metavar="OUT.jsonl",
                 help="Batch results, one line per input, appended as they are done; a re-run skips ids already in "
                      "it."),
    click.option("--workers", type=COUNT, default=None,
                 help="Batch mode: worker processes, each loading the model [default: 1; with --ray: CPUs / "
                      "threads]."),
    click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
                 help="Batch mode or --server on Ray: a local Ray, or join the cluster at ADDRESS "
                      "(pip install 'synapse_nb[ray]')."),
])

perplexity_options = _compose([
    click.option("--perplexity", "ppl", is_flag=True,
                 help="Perplexity of the -f text as llama-perplexity computes it (-c default 512)."),
    click.option("--kl-divergence-base", "kld_base", type=str, default=None, metavar="FILE",
                 help="Alone: also write our log-probabilities to FILE (llama.cpp .kld, never overwrites); "
                      "with --kl-divergence: the base file to compare against."),
    click.option("--kl-divergence", "kl_div", is_flag=True,
                 help="KL divergence of our token distributions against --kl-divergence-base FILE."),
    _int_option(_R["chunks"]),
])

grammar_options = _compose([
    click.option("--grammar", type=str, default=None, metavar="GBNF",
                 help="Constrain the output with this GBNF grammar (llama.cpp's grammar syntax)."),
    click.option("--grammar-file", type=str, default=None, metavar="FILE", help="The GBNF grammar from FILE."),
    click.option("-j", "--json-schema", type=str, default=None, metavar="SCHEMA",
                 help="Constrain the output to JSON of this JSON schema (converted to GBNF as llama.cpp does)."),
    click.option("-jf", "--json-schema-file", type=str, default=None, metavar="FILE",
                 help="The JSON schema from FILE."),
])


def _sampling_option(p):
    """A sampling option of the table; not given is None (greedy unless some option is given)."""
    if p.kind == "bias":
        return click.option(*p.flags, p.key, multiple=True, metavar=p.metavar, help=p.help + ".")
    kind = float if p.kind == "float" else AtLeast(p.lo, p.note, p.hi)
    return click.option(*p.flags, p.key, type=kind, default=None, metavar=p.metavar, help=f"{p.help} [{p.default}].")


# The sampling options (llama.cpp's names and meanings), passed to the command as **sampling: any
# of them switches from greedy decoding to llama.cpp's sampler chain (synapse_nb.sampling), the
# options not given taking llama.cpp's defaults. The samplers not implemented are refused by
# name (hidden options, synapse_nb.sampling.given_options says why).
sampling_options = _compose([_sampling_option(p) for p in SAMPLING] +
                            [click.option(flag, key, type=str, default=None, hidden=True)
                             for key, (flag, _) in REFUSED_SAMPLERS.items()])

# llama-completion's common flags that a llama.cpp user types, with llama.cpp's meanings (or
# refused by their own name). Passed to the command as compat_* in **sampling, taken out first.
llama_cpp_options = _compose([
    click.option("-no-cnv", "--no-conversation", "compat_no_cnv", is_flag=True,
                 help="No conversation mode (the default here, as llama-completion's -no-cnv)."),
    click.option("-fa", "--flash-attn", "compat_flash_attn", type=click.Choice(["on", "off", "auto"]),
                 default=None, help="Flash attention: off or auto (computed without it); on is refused."),
    click.option("-ub", "--ubatch-size", "compat_ubatch", type=COUNT, default=None, metavar="N",
                 help="Accepted for llama.cpp's command lines and ignored: results do not depend on it."),
    click.option("--display-prompt/--no-display-prompt", "compat_display_prompt", default=False,
                 show_default=True, help="Print the prompt before the generated text (llama.cpp's default "
                                         "is to print it)."),
    click.option("-e", "--escape/--no-escape", "compat_escape", default=True, show_default=True,
                 help="Process escapes (\\n, \\t, \\\\, \\', \\\", \\xNN) in -p, as llama.cpp does by default."),
    click.option("--color", "compat_color", is_flag=True, hidden=True),
    click.option("-i", "--interactive", "compat_interactive", is_flag=True, hidden=True),
    click.option("-if", "--interactive-first", "compat_interactive_first", is_flag=True, hidden=True),
])


def apply_llama_cpp_options(compat: dict, conversation: bool):
    """(conversation, display_prompt) after llama-completion's flags; UsageError for the refused ones."""
    if compat["flash_attn"] == "on":
        raise click.UsageError("-fa/--flash-attn on: flash attention is not implemented; llama-decode computes "
                               "as llama.cpp with -fa off (give off or auto, or leave it out)")
    if compat["interactive"] or compat["interactive_first"]:
        raise click.UsageError("-i/--interactive is not supported; use -cnv/--conversation for a chat")
    if compat["ubatch"] is not None:
        log("warning: -ub/--ubatch-size is ignored: llama-decode's results do not depend on the batch sizes "
            "(-b sets the prefill batch)")
    # --color: accepted, nothing is colored. -no-cnv: conversation off, whatever -cnv said
    return conversation and not compat["no_cnv"], compat["display_prompt"]
